"""Tool definitions for tests: a tracker that is not tasks.* (the sandbox, named tickets)."""

from __future__ import annotations

from typing import Any

from runtime.models import Action, Tenant, ToolDefinition
from runtime.tooldefs import define, define_many, digest


def tickets(url: str, mode: str = "key", **changes: Any) -> list[dict[str, Any]]:
    """`tickets.create` and its compensation `tickets.close`, sent to the sandbox at `url`
    with dedup `mode`; `changes` replace fields of tickets.create."""
    create: dict[str, Any] = {
        "name": "tickets.create",
        "description": "Open a ticket",
        "title": "Open ticket: {title}",
        "effect": "write",
        "schema": {
            "type": "object",
            "properties": {"title": {"type": "string", "minLength": 1, "maxLength": 200}},
            "required": ["title"],
            "additionalProperties": False,
        },
        "editable": ["title"],
        "executor": "http",
        "request": {"method": "POST", "url": f"{url}/tasks", "headers": {"X-Team": "ops"}},
        "dedup": {"mode": mode, "header": "Idempotency-Key"},
        "lookup": {
            "method": "GET",
            "url": f"{url}/tasks?key={{idempotency_key}}",
            "found": "$[0].id",
        },
        "result": {"external_id": "$.id"},
        "timeout_seconds": 3,
        "compensation": "tickets.close",
        "compensation_param": "ticket",
    }
    close: dict[str, Any] = {
        "name": "tickets.close",
        "effect": "write",
        "schema": {
            "type": "object",
            "properties": {"ticket": {"type": "string"}},
            "required": ["ticket"],
        },
        "executor": "http",
        "request": {"method": "POST", "url": f"{url}/tasks/{{ticket}}/close"},
        "dedup": {"mode": "key"},
        "timeout_seconds": 3,
    }
    return [close, {**create, **changes}]


def define_tickets(tenant: Tenant, url: str, mode: str = "key", **changes: Any) -> ToolDefinition:
    """Define the tickets tools for `tenant`; the tickets.create definition stored."""
    defined = define_many(tenant, tickets(url, mode, **changes), "user:admin")
    return defined[-1].definition


def run_ticket(tenant: Tenant, url: str, mode: str = "none", **changes: Any) -> Action:
    """Define tickets.create at `url` (no approval: a policy lets it go), start a ticketing
    run and advance it one step in this process; its action."""
    from approvals.models import ApprovalPolicy
    from runtime.executor import advance_run
    from runtime.lifecycle import create_run

    for item in tickets(url, mode, **changes):
        define(tenant, item, "user:admin", known_tools=["tickets.close"])
    ApprovalPolicy.objects.get_or_create(
        tenant=tenant, name="tickets go", defaults={"tool": "tickets.create", "required": False}
    )
    run = create_run(tenant, "ticketing", {"title": "probe"}, actor="user:t")
    advance_run(run.run_id, "w1")
    return Action.objects.get(run=run)


def store_unchecked(row: ToolDefinition, spec: dict[str, Any]) -> ToolDefinition:
    """`row`'s next version with `spec`, stored as a definition from before a check refused
    it (past `define`'s checks). With its real digest: tools are cached by digest in the
    process, so a made-up one shared by two tests hands one test the other's tool."""
    return ToolDefinition.objects.create(
        tenant=row.tenant,
        name=row.name,
        version=row.version + 1,
        spec=spec,
        digest=digest(spec),
        created_by="user:admin",
    )
