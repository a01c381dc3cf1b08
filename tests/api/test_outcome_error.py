"""A `failed` outcome an external executor reports keeps its refusal as the action's
`last_error`, as Holdpoint's own sends keep theirs.

The client reports a ToolRefused as `failed` with `result: {"error": <the refusal>}`
(holdpoint_client/executor.py); a tool Holdpoint sends itself that fails has the service's
words in `last_error` (runtime/dispatch.py). The run page's timeline and `GET actions/{id}/`
read `last_error`.
"""

from __future__ import annotations

from typing import Any

import pytest

from runtime.models import Action
from tests.api import get, ok, post, prepare
from tests.api.test_executor_protocol import CLIENT, dispatch, leased, outcome
from tests.conftest import Persona

pytestmark = pytest.mark.django_db

REFUSAL = "the tracker refused it: a task with this title exists"


@pytest.mark.parametrize("revised", [False, True], ids=["current goal", "goal revised since"])
def test_a_failed_outcome_keeps_the_reported_error_as_last_error(
    agent_a: Persona, revised: bool
) -> None:
    """The action was `failed` with `result.error` set and `last_error` empty: the API (and
    the run page, and the client's ActionFailed after a restart reading `last_error` first)
    said nothing of why. Now `last_error` is the reported error — also for an answer that
    comes after the goal was revised (a late result settles its action all the same)."""
    client = agent_a.api()
    run_id, fence = leased(client)
    action = ok(prepare(client, run_id, fence, tool=CLIENT), 201)
    ok(dispatch(client, action["action_id"], fence))
    if revised:
        body: dict[str, Any] = {"goal": {"x": 1}, "expected_goal_rev": 1}
        ok(post(client, f"runs/{run_id}/revisions/", body))

    answered = ok(outcome(client, action["action_id"], fence, "failed", result={"error": REFUSAL}))

    assert (answered["status"], answered["last_error"]) == ("failed", REFUSAL)
    shown = ok(get(client, f"actions/{action['action_id']}/"))
    assert (shown["last_error"], shown["result"]) == (REFUSAL, {"error": REFUSAL})
    assert Action.objects.get(pk=action["action_id"]).last_error == REFUSAL
