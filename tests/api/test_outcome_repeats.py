"""An outcome report repeated, and a different report for an action it already settled.

An executor whose answer was lost sends the same report again: it gets 200 with the action
as it is now, nothing written twice. A report that says anything else of an action a report
already settled — another outcome word, another external id, another `result` — is
409 `invalid_transition` (API.md, "Executor protocol"): the first report stands, and the
client learns that what it says now was not recorded. The same report is the same
outcome, external id and result (the result compared as canonical JSON, so key order and
number spelling do not matter).
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import transaction

from audit.journal import run_stream
from audit.models import JournalEntry
from runtime import ledger
from runtime.models import Action, ActionStatus
from tests.api import fresh_throttle, ok, post, prepare, problem  # noqa: F401
from tests.api.test_executor_protocol import CLIENT, dispatch, leased, outcome
from tests.conftest import Persona

pytestmark = pytest.mark.django_db

Report = dict[str, Any]


def entries(run_id: str) -> int:
    return JournalEntry.objects.filter(stream=run_stream(run_id)).count()


def report(client: Any, action_id: str, fence: int, said: Report) -> Any:
    fields = {k: v for k, v in said.items() if k != "outcome"}
    return outcome(client, action_id, fence, said["outcome"], **fields)


def sent(agent: Persona, *, revised: bool = False) -> tuple[Any, str, str, int]:
    """A client tool's action marked `sent` (and the goal revised since, if `revised`)."""
    client = agent.api()
    run_id, fence = leased(client)
    action = ok(prepare(client, run_id, fence, tool=CLIENT), 201)
    ok(dispatch(client, action["action_id"], fence))
    if revised:
        ok(post(client, f"runs/{run_id}/revisions/", {"goal": {"x": 1}, "expected_goal_rev": 1}))
    return client, run_id, action["action_id"], fence


CONFIRMED: Report = {"outcome": "confirmed", "external_id": "T-1", "result": {"id": "T-1"}}
FAILED: Report = {"outcome": "failed", "result": {"error": "refused: the title exists"}}
DIFFERENT = [
    (CONFIRMED, {**CONFIRMED, "result": {"id": "T-1", "url": "/t/1"}}),
    (CONFIRMED, {**CONFIRMED, "result": None}),
    (CONFIRMED, {**CONFIRMED, "external_id": "T-2"}),
    (CONFIRMED, FAILED),
    (CONFIRMED, {"outcome": "unknown", "result": {"id": "T-1"}}),
    (FAILED, {**FAILED, "result": {"error": "refused: over quota"}}),
    (FAILED, {**FAILED, "external_id": "T-1"}),
    (FAILED, CONFIRMED),
]
IDS = [
    "confirmed-other-result",
    "confirmed-no-result",
    "confirmed-other-id",
    "confirmed-then-failed",
    "confirmed-then-unknown",
    "failed-other-error",
    "failed-with-an-id",
    "failed-then-confirmed",
]


@pytest.mark.parametrize("revised", [False, True], ids=["current goal", "late"])
@pytest.mark.parametrize(("first", "second"), DIFFERENT, ids=IDS)
def test_a_different_report_for_a_settled_action_is_409_and_changes_nothing(
    agent_a: Persona, first: Report, second: Report, revised: bool
) -> None:
    """A second report that differs from the one that settled the action only in its result
    (or its external id, for a `failed`) answered 200 and kept the first silently: the
    client believed its second report recorded. Any difference is now 409
    invalid_transition, also for a late report (the goal revised since the send)."""
    client, run_id, action_id, fence = sent(agent_a, revised=revised)
    settled = ok(report(client, action_id, fence, first))
    written = entries(run_id)

    problem(report(client, action_id, fence, second), 409, "invalid_transition")

    stored = Action.objects.get(pk=action_id)
    assert (stored.status, stored.external_id, stored.result) == (
        settled["status"],
        settled["external_id"],
        settled["result"],
    )
    assert entries(run_id) == written


@pytest.mark.parametrize("revised", [False, True], ids=["current goal", "late"])
@pytest.mark.parametrize("first", [CONFIRMED, FAILED], ids=["confirmed", "failed"])
def test_the_same_report_again_is_200_with_the_action_unchanged(
    agent_a: Persona, first: Report, revised: bool
) -> None:
    """A retry after a lost answer: the same report, its result spelled differently as JSON
    (keys in another order, 1.0 for 1) — the same canonical JSON — answers 200 with the
    action as the first left it, and writes nothing."""
    client, run_id, action_id, fence = sent(agent_a, revised=revised)
    said = {**first, "result": {**first["result"], "n": 1, "a": [1]}}
    settled = ok(report(client, action_id, fence, said))
    written = entries(run_id)
    respelled = {**said, "result": {"a": [1.0], "n": 1.0, **first["result"]}}

    again = ok(report(client, action_id, fence, respelled))

    assert again == settled
    assert entries(run_id) == written


def test_a_different_unknown_for_an_action_a_person_holds_is_409(
    agent_a: Persona, settings: Any
) -> None:
    """An `unknown` of a tool that can neither deduplicate nor be looked up hands the action
    to a person; a second `unknown` saying something else answered 200 as if it were the
    first one again. Now only the same report is: another one is 409."""
    settings.HOLDPOINT_TASKS_DEDUP = "none"
    client, run_id, action_id, fence = sent(agent_a)
    said: Report = {"outcome": "unknown", "result": {"error": "timed out"}}
    assert ok(report(client, action_id, fence, said))["status"] == "manual_review"
    written = entries(run_id)

    assert ok(report(client, action_id, fence, said))["status"] == "manual_review"
    other = {"outcome": "unknown", "result": {"error": "connection reset"}}
    problem(report(client, action_id, fence, other), 409, "invalid_transition")

    assert Action.objects.get(pk=action_id).status == ActionStatus.MANUAL_REVIEW
    assert entries(run_id) == written


def test_another_unknown_for_an_unsettled_action_is_a_new_report(agent_a: Persona) -> None:
    """`unknown` settles nothing: a second `unknown` that says something else (a lookup
    that failed another way) is a report of its own — counted as another attempt, its
    result kept — not a repeat of the first, and not a refusal."""
    client, _, action_id, fence = sent(agent_a)
    first = ok(report(client, action_id, fence, {"outcome": "unknown", "result": {"e": "a"}}))

    second = ok(report(client, action_id, fence, {"outcome": "unknown", "result": {"e": "b"}}))

    assert (first["status"], second["status"]) == ("unknown", "unknown")
    stored = Action.objects.get(pk=action_id)
    assert (stored.reconcile_attempts, stored.result) == (2, {"e": "b"})


def test_a_report_journalled_before_reports_carried_a_digest_is_known_again(
    agent_a: Persona,
) -> None:
    """A report recorded before this release journalled only its outcome word and, for
    `confirmed`, its id. A retry arriving after the upgrade (an answer lost to the restart)
    is still known by those — 200 — and anything else is still refused."""
    client, run_id, action_id, fence = sent(agent_a)
    sending = JournalEntry.objects.get(stream=run_stream(run_id), type="action_outcome")
    earlier = {"reported_by": sending.actor.rsplit("#", 1)[0], "executor_owner": "agent-1"}
    with transaction.atomic():  # what record_outcome wrote for a report before the upgrade
        ledger.transition(
            Action.objects.get(pk=action_id),
            ActionStatus.CONFIRMED,
            sending.actor,
            journal_extra={**earlier, "outcome": "confirmed"},
            external_id="T-1",
            result={"id": "T-1"},
        )
    written = entries(run_id)

    assert ok(report(client, action_id, fence, CONFIRMED))["status"] == "confirmed"
    other_id = {**CONFIRMED, "external_id": "T-2"}
    problem(report(client, action_id, fence, other_id), 409, "invalid_transition")
    problem(report(client, action_id, fence, FAILED), 409, "invalid_transition")
    assert entries(run_id) == written
