"""A paid call under the default key is made once per step visit, however often the visit
runs again: after a side-effect checkpoint the step's re-execution (a retry here; a crash,
an approval or a graph migration alike) finds the recorded result instead of paying again.
"""

from __future__ import annotations

from collections import Counter

from runtime.context import StepContext
from runtime.executor import advance_run
from runtime.graphs import Complete, Graph, Outcome, register, registry
from runtime.lifecycle import create_run
from runtime.models import Action, RecordedCall, RunStatus, Tenant
from runtime.tools import register_tool
from tests.graphs import NoteTool
from tests.runtime.helpers import make_due

PAID: Counter[str] = Counter()
ATTEMPTS: Counter[str] = Counter()

register_tool(NoteTool(name="test.plain_note", schema={"type": "object"}))
thinker = Graph("thinker", version="1", tools=("test.plain_note",), retry_base=0.01)


@thinker.step(start=True)
def think_then_act(ctx: StepContext) -> Outcome:
    run = str(ctx.run_id)
    idea = ctx.model("draft", lambda: (PAID.update([run]), f"idea {PAID[run]}")[1])
    note = ctx.act("test.plain_note", {"idea": idea})
    ATTEMPTS[run] += 1
    if ATTEMPTS[run] == 1:
        raise RuntimeError("flaky after acting")
    return Complete(update={"idea": idea, "note": note.external_id})


def test_a_recorded_call_is_reused_when_its_visit_runs_again(tenant_a: Tenant) -> None:
    register(thinker)
    try:
        run = create_run(tenant_a, "thinker", {}, actor="t")
        assert advance_run(run.run_id, "w1").outcome == "retrying"
        run.refresh_from_db()
        assert run.checkpoint_rev > run.step_rev  # the action's checkpoints, mid-visit
        make_due(run)
        assert advance_run(run.run_id, "w1").outcome == "completed"
    finally:
        registry.unregister("thinker", "1")
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED
    assert PAID[str(run.run_id)] == 1  # paid once, reused on the second execution
    assert RecordedCall.objects.filter(run=run).count() == 1
    assert Action.objects.filter(run=run).count() == 1
