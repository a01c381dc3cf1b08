"""Late answers (DESIGN.md invariant 6): a worker's request is out when the goal is revised.

The answer still says what happened to the effect, so it settles the action as it would
have (runtime.outcomes.record_late_result): a refusal is `failed`, a certain "not applied"
withdraws it (no step sends an old revision's action), an unknown of a tool with neither
key nor lookup goes to a person. The new revision goes on as if the step had never run: the
old action's answer neither advances nor derails it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from runtime import outcomes
from runtime.artifacts import resolve
from runtime.context import StepContext
from runtime.executor import advance_run
from runtime.graphs import Complete, Graph, Outcome, register, registry
from runtime.lifecycle import create_run, revise_goal
from runtime.models import Action, ActionStatus, Checkpoint, Run, RunStatus, Tenant
from runtime.tools import CallResult, Dedup, Tool, register_tool
from tests.runtime.helpers import payloads

ANSWERS: dict[str, CallResult] = {}
CALLS: Counter[str] = Counter()


class RevisedMeanwhile(Tool):
    """A service whose answer arrives after the goal was revised: while the request is out a
    user revises the run's goal, then the service answers what the test set."""

    def call(self, params_text: str, *, key: str, fence: int, run_id: str) -> CallResult:
        CALLS[run_id] += 1
        run = Run.objects.get(pk=run_id)
        if run.goal_rev == 1:
            revise_goal(run, {"v": 2}, 1, actor="user:u")
        return ANSWERS[run_id]


for _mode in (Dedup.KEY, Dedup.NONE):
    register_tool(RevisedMeanwhile(name=f"test.revised_{_mode}", dedup=_mode))


def _graph(mode: str) -> Graph:
    """Acts under goal_rev 1 only; under the revised goal it completes at once."""
    graph = Graph(f"late_{mode}", version="1", tools=(f"test.revised_{mode}",))

    @graph.step(start=True)
    def act(ctx: StepContext) -> Outcome:
        if ctx.goal_rev == 1:
            ctx.act(f"test.revised_{mode}", {"n": 1}, reason="the old goal")
        return Complete(update={"done_under": ctx.goal_rev})

    return graph


REFUSED = CallResult("refused", detail="no such project")
LOST = CallResult("unknown", detail="connection reset")
BUSY = CallResult("refused", transient=True, detail="busy, try later")


@pytest.mark.parametrize(
    ("mode", "answer", "settled", "run_status"),
    [
        ("key", REFUSED, ActionStatus.FAILED, RunStatus.COMPLETED),
        ("none", REFUSED, ActionStatus.FAILED, RunStatus.COMPLETED),
        ("key", BUSY, ActionStatus.CANCELLED, RunStatus.COMPLETED),
        ("none", LOST, ActionStatus.MANUAL_REVIEW, RunStatus.NEEDS_RECONCILIATION),
        ("key", LOST, ActionStatus.MANUAL_REVIEW, RunStatus.NEEDS_RECONCILIATION),
    ],
    ids=["failed-key", "failed-none", "not-applied", "unknown-none", "unknown-key"],
)
def test_a_late_answer_settles_its_action_and_the_new_revision_goes_on(
    tenant_a: Tenant, mode: str, answer: CallResult, settled: str, run_status: str
) -> None:
    """Before: the late answer was kept only as the action's result and the action stayed
    `sent`; the step then went on with it — a `failed` of a key tool was sent again with its
    key after the revision and, refused, escalated the new revision's run (needs_attention);
    of a `none` tool it went to a person though the service had said no; a certain "not
    applied" left it `sent` for ever. And an unknown of a key tool was replayed with its key
    after the revision — a send of the old revision's action, which makes its effect, now,
    where the first request never arrived: only a person can say whether it applied."""
    graph = register(_graph(mode))
    try:
        run = create_run(tenant_a, graph.name, {"v": 1}, actor="t")
        ANSWERS[str(run.run_id)] = answer
        advance_run(run.run_id, "w1")
    finally:
        registry.unregister(graph.name, "1")
    action = Action.objects.get(run=run)
    run.refresh_from_db()
    assert (action.status, action.goal_rev, run.goal_rev) == (settled, 1, 2)
    assert run.status == run_status
    assert CALLS[str(run.run_id)] == 1  # never sent again after the revision
    assert payloads(run, "late_result_ignored")[0]["outcome"] == answer.outcome
    if settled == ActionStatus.MANUAL_REVIEW:
        assert run.waiting_for["action_id"] == str(action.action_id)
    else:
        assert action.last_error.startswith(("no such project", "not applied, and the goal"))


FLAKY: Counter[str] = Counter()


class AnswersLate(Tool):
    """A key-deduplicating service whose first three answers are lost, the fourth arrives."""

    def call(self, params_text: str, *, key: str, fence: int, run_id: str) -> CallResult:
        FLAKY[run_id] += 1
        if FLAKY[run_id] <= 3:
            return CallResult("unknown", detail="connection reset")
        return CallResult("applied", external_id=f"T-{key}")


register_tool(AnswersLate(name="test.answers_late", dedup=Dedup.KEY))


def _advance_until_done(run: Run) -> None:
    """Advance it as a worker would, its back-off waived, until it completes or stops."""
    for _ in range(4):
        Run.objects.filter(pk=run.pk).update(wake_at=None, lease_expires_at=None)
        if advance_run(run.run_id, "w1").outcome == "completed":
            return


def test_a_reconcile_at_start_never_skips_a_pending_revision(tenant_a: Tenant) -> None:
    """The goal is revised while a run waits to reconcile an unknown action. The next start
    reconciled first and parked again (another unknown) with a checkpoint stamped with the
    new goal_rev but the old revision's state and step: the revision hook never ran, and the
    step acted on the old state under the new goal. The revision is applied first now."""
    graph = Graph("late_revisable", version="1", tools=("test.answers_late",))

    @graph.step(start=True)
    def act(ctx: StepContext) -> Outcome:
        ctx.act("test.answers_late", {"n": ctx.goal["v"]}, reason="the goal says so")
        return Complete(update={"seen": dict(ctx.state), "goal": ctx.goal["v"]})

    @graph.on_revision
    def revised(state: dict[str, Any], old: Any, new: Any) -> tuple[dict[str, Any], str]:
        return {"evidence": "kept by the hook"}, "act"

    register(graph)
    try:
        run = create_run(tenant_a, graph.name, {"v": 1}, actor="t")
        assert advance_run(run.run_id, "w1").outcome == "retrying"  # unknown: reconcile later
        sent_before = FLAKY[str(run.run_id)]
        revise_goal(Run.objects.get(pk=run.pk), {"v": 2}, 1, actor="user:u")
        _advance_until_done(run)
    finally:
        registry.unregister(graph.name, "1")
    # The old revision's action is unknown and its tool only deduplicates by key: a replay
    # would send it after the revision, so a person says — here, that it did apply.
    run.refresh_from_db()
    assert run.status == RunStatus.NEEDS_RECONCILIATION
    assert FLAKY[str(run.run_id)] == sent_before  # never replayed after the revision
    old = Action.objects.get(run=run, goal_rev=1)
    assert old.status == ActionStatus.MANUAL_REVIEW
    outcomes.resolve(old, "applied", actor="user:u", external_id="T-1")
    assert Action.objects.get(pk=old.pk).status == ActionStatus.CONFIRMED
    register(graph)
    try:
        _advance_until_done(run)
    finally:
        registry.unregister(graph.name, "1")
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED
    assert payloads(run, "revision_applied"), "the revision hook never ran"
    final = resolve(run.tenant_id, Checkpoint.objects.get(run=run, rev=run.checkpoint_rev).state)
    assert final["seen"] == {"evidence": "kept by the hook"} and final["goal"] == 2
