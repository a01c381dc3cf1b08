"""A lookup's "absent" lets an action be sent again, so only an answer that says "nothing"
gives it: a 404, or the `found` path stopping at an empty list or object or at null. An
answer with a record the path does not reach into (a `found` naming the wrong field) was
"absent" too: every reconcile of such a tool sent the action again — a duplicate effect for
each lost answer. It is no answer now: asked again, then a person. Real sockets: a small
server for each answer, the sandbox (mode lookup) for the whole reconcile.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from runtime.executor import advance_run
from runtime.models import Action, ActionStatus, Run, Tenant
from runtime.tools import get_tool
from tests.httpservers import Behaviour, Server, answer_with
from tests.sandbox import Sandbox
from tests.tooldefs import define_tickets, run_ticket

pytestmark = pytest.mark.django_db
S = ActionStatus


@pytest.mark.parametrize(
    ("status", "answer", "found", "verdict"),
    [
        (404, {"error": "no such key"}, "$[0].id", False),
        (200, [], "$[0].id", False),  # the sandbox's answer for a key it never saw
        (200, {"tasks": []}, "$.tasks[0].id", False),
        (200, {"task": None}, "$.task.id", False),
        (200, {}, "$.id", False),
        (200, [{"id": "T-1"}], "$[0].id", True),
        # The definition's own filter chose none of the records: absent, as before.
        (200, {"tasks": [{"key": "other", "id": 1}]}, "$.tasks[?@.key=='k-1'].id", False),
        (200, [{"key": "other", "id": 1}], "$[?@.key=='k-1'].id", False),
        (200, {"tasks": [{"key": "k-1", "id": 7}]}, "$.tasks[?@.key=='k-1'].id", True),
        # The filter chose a record, and the path does not reach into it: no answer.
        (200, {"tasks": [{"key": "k-1", "n": 7}]}, "$.tasks[?@.key=='k-1'].id", None),
        # Something is there, and the path does not reach into it: no answer.
        (200, [{"id": "T-1", "title": "x"}], "$[0].task_id", None),
        (200, {"id": "T-1"}, "$.task_id", None),
        (200, [{"id": "T-1"}], "$.results[0].id", None),
        (200, {"found": False}, "$.id", None),  # an HTTP service says "none" with a 404
    ],
)
def test_only_an_answer_that_says_nothing_is_absent(
    tenant_a: Tenant,
    serve: Callable[[Behaviour], Server],
    status: int,
    answer: Any,
    found: str,
    verdict: bool | None,
) -> None:
    server = serve(answer_with(status, json.dumps(answer).encode()))
    lookup = {"url": f"{server.url}/tasks?key={{idempotency_key}}", "found": found}
    define_tickets(tenant_a, server.url, "lookup", lookup=lookup)
    looked = get_tool("tickets.create", tenant_a.pk).lookup("k-1", run_id=str(uuid.uuid4()))
    assert looked.found is verdict, looked
    if verdict is None:
        assert found in looked.detail


def test_a_lookup_with_a_wrong_found_path_never_sends_the_action_again(
    tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox], settings: Any
) -> None:
    """The sandbox applies the create and loses its answer; the definition's `found` names a
    field its answer does not have. Before: "absent" once the sender could no longer be in
    flight, and the action went out again — two tasks. Now a person is asked."""
    settings.HOLDPOINT_RECONCILE_ATTEMPTS = 3
    box = sandbox_factory("lookup")
    box.faults(drop_after=1)
    lookup = {"url": f"{box.url}/tasks?key={{idempotency_key}}", "found": "$[0].task_id"}
    action = run_ticket(tenant_a, box.url, "lookup", lookup=lookup)
    for _ in range(6):
        if action.status == S.MANUAL_REVIEW:
            break
        past = timezone.now() - timedelta(minutes=5)  # the first send can no longer land
        Action.objects.filter(pk=action.pk).update(in_flight_until=past)
        Run.objects.filter(pk=action.run_id).update(wake_at=None)
        advance_run(action.run_id, "w1")
        action.refresh_from_db()

    assert len(box.tasks()) == 1  # applied once, never sent again
    assert action.status == S.MANUAL_REVIEW, (action.status, action.last_error)
    assert "$[0].task_id" in action.last_error
