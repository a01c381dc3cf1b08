"""Request examples for the main calls, shown in the OpenAPI document and Swagger UI."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiExample

CREATE_RUN = OpenApiExample(
    "Start an api-review run",
    request_only=True,
    value={
        "graph": "api-review",
        "goal": {
            "old_spec": "shop-v1",
            "new_spec": "shop-v2",
            "scope": ["/orders", "/users"],
            "create_review_task": True,
        },
    },
)
CREATE_EXTERNAL_RUN = OpenApiExample(
    "A run your own loop executes",
    request_only=True,
    value={
        "graph": "api-review",
        "goal": {"old_spec": "shop-v1", "new_spec": "shop-v2", "scope": ["/orders"]},
        "external": True,
    },
)
REVISE = OpenApiExample(
    "Narrow the goal",
    request_only=True,
    value={
        "goal": {
            "old_spec": "shop-v1",
            "new_spec": "shop-v2",
            "scope": ["/orders"],
            "create_review_task": False,
        },
        "expected_goal_rev": 1,
    },
)
LEASE = OpenApiExample(
    "Take the lease", request_only=True, value={"owner": "agent-7f3a", "ttl_seconds": 30}
)
CHECKPOINT = OpenApiExample(
    "Commit a step",
    request_only=True,
    value={"fence": 3, "expected_rev": 4, "state": {"risks": 3}, "next_step": "propose_task"},
)
PREPARE = OpenApiExample(
    "Prepare a side effect",
    request_only=True,
    value={
        "fence": 3,
        "tool": "tasks.create",
        "params": {"title": "Review 3 API compatibility risks", "body": "- POST /orders …"},
        "reason": "The new API version breaks clients",
        "idempotency_key": "run-42:propose:1",
        "expected_goal_rev": 1,
    },
)
DISPATCH = OpenApiExample("Mark sent, then call the tool", request_only=True, value={"fence": 3})
OUTCOME = OpenApiExample(
    "Record a verifiable result",
    request_only=True,
    value={
        "fence": 3,
        "outcome": "confirmed",
        "external_id": "TASK-1042",
        "result": {"url": "https://tracker.example/TASK-1042"},
    },
)
DECIDE = OpenApiExample(
    "Approve what you saw",
    request_only=True,
    value={"decision": "approve", "action_hash": "9f2c…(64 hex)", "reason": "Looks right"},
)
RESOLVE = OpenApiExample(
    "It did happen",
    request_only=True,
    value={"outcome": "applied", "external_id": "TASK-1042", "note": "found it in the tracker"},
)
