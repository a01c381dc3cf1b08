"""An external agent on a tool the tenant defined as data and Holdpoint sends itself
(executor `http`): `run.act` with no `perform` — the server sends the request at dispatch and
the agent gets the recorded answer; the default hold point (a write tool no policy names)
applies to it as to any tool. Real sockets: the API by `live_server`, the real sandbox."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from holdpoint_client import Holdpoint
from runtime.models import Action, Run, RunStatus
from tests.client import decide, the_action
from tests.conftest import Persona
from tests.sandbox import Sandbox
from tests.tooldefs import define_tickets

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_an_external_agent_acts_through_a_defined_http_tool_held_by_default(
    live_server: Any,
    agent_a: Persona,
    reviewer_a: Persona,
    sandbox_factory: Callable[[str], Sandbox],
) -> None:
    decoy = sandbox_factory("key")  # where the built-in tasks.* would go
    box = sandbox_factory("key")
    define_tickets(agent_a.tenant, box.url)
    assert agent_a.token is not None
    hp = Holdpoint(live_server.url, agent_a.token, ttl=3, backoff=0.01)
    answers: list[Any] = []

    def agent() -> None:
        with hp.run("ticket-7", graph="api-review") as run:
            answers.append(run.act("tickets.create", {"title": "Rotate keys"}, reason="audit"))

    worker = threading.Thread(target=agent)
    worker.start()
    try:
        held = the_action("ticket-7", "awaiting_approval")
        assert box.tasks() == []  # nothing leaves before the reviewer says so
        decide(reviewer_a, held, edits={"title": "Rotate the signing keys"})
        worker.join(timeout=60)
    finally:
        worker.join(timeout=5)
        hp.close()
    [task] = box.tasks()
    assert task["title"] == "Rotate the signing keys"  # the approved, edited params were sent
    assert answers and answers[0]["id"] == task["id"]
    (action,) = Action.objects.filter(run__thread_id="ticket-7")
    assert (action.tool, action.status, action.external_id) == (
        "tickets.create",
        "confirmed",
        task["id"],
    )
    assert Run.objects.get(thread_id="ticket-7").status == RunStatus.COMPLETED
    assert decoy.tasks() == []
