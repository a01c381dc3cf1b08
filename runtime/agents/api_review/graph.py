"""The api-review agent: which changes between two API versions break clients?

Goal: {"old_spec": "shop-v1", "new_spec": "shop-v2", "scope": ["/orders", "/users"],
"create_review_task": true}. Reads both documents (recorded: never read twice for a run),
analyses each scope prefix separately (recorded per prefix: the evidence a goal revision can
keep), writes `report.risks`, and, if asked, proposes a review task in the tracker — a side
effect that waits at a hold point.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from runtime.agents.api_review.diff import find_risks, load_spec
from runtime.context import StepContext
from runtime.dispatch import ActionRejected
from runtime.graphs import Complete, Graph, Next, Outcome, register

DEFAULT_GOAL = {
    "old_spec": "shop-v1",
    "new_spec": "shop-v2",
    "scope": ["/orders", "/users"],
    "create_review_task": True,
}

graph = Graph(
    "api-review",
    version="1",
    tools=("tasks.create",),
    description="Finds backward-compatibility risks between two OpenAPI documents.",
    default_goal=DEFAULT_GOAL,
)


def _specs(goal: dict[str, Any]) -> tuple[str, str]:
    return str(goal["old_spec"]), str(goal["new_spec"])


@graph.step(start=True)
def read_specs(ctx: StepContext) -> Outcome:
    old_name, new_name = _specs(ctx.goal)
    for name in (old_name, new_name):
        ctx.record(f"spec:{name}", partial(load_spec, name))
    return Next("analyse", update={"specs": [old_name, new_name]})


@graph.step
def analyse(ctx: StepContext) -> Outcome:
    """Evidence per scope prefix; prefixes analysed before (same specs) are reused as is."""
    old_name, new_name = _specs(ctx.goal)
    old = ctx.record(f"spec:{old_name}", lambda: load_spec(old_name))
    new = ctx.record(f"spec:{new_name}", lambda: load_spec(new_name))
    evidence = dict(ctx.state.get("evidence", {}))
    for prefix in ctx.goal["scope"]:
        key = f"{old_name}..{new_name}:{prefix}"
        if key not in evidence:
            evidence[key] = ctx.record(f"analysis:{key}", partial(find_risks, old, new, [prefix]))
    return Next("report", update={"evidence": evidence})


@graph.step
def report(ctx: StepContext) -> Outcome:
    old_name, new_name = _specs(ctx.goal)
    risks = [
        risk
        for prefix in ctx.goal["scope"]
        for risk in ctx.state["evidence"][f"{old_name}..{new_name}:{prefix}"]
    ]
    summary = {
        "old_spec": old_name,
        "new_spec": new_name,
        "scope": list(ctx.goal["scope"]),
        "risks": risks,
    }
    if ctx.goal.get("create_review_task") and risks:
        return Next("propose_task", update={"report": summary})
    return Complete(update={"report": summary})


def review_reason(report_: dict[str, Any]) -> str:
    """The reviewer's "why": the evidence itself, one Markdown bullet per risk found, so the
    card shows each risk instead of a generic sentence (approvals.card renders it safely)."""
    risks = report_["risks"]
    lines = [f"- `{r['method']} {r['path']}` — **{r['kind']}**: {r['detail']}" for r in risks]
    return (
        f"The new API version `{report_['new_spec']}` breaks clients of "
        f"`{report_['old_spec']}` in {len(risks)} place(s):\n\n" + "\n".join(lines)
    )


@graph.step
def propose_task(ctx: StepContext) -> Outcome:
    """Open one review task in the tracker — through the ledger, so exactly once; a hold
    point when the tenant's policy says so."""
    report_ = ctx.state["report"]
    lines = [f"- {r['method']} {r['path']}: {r['kind']} — {r['detail']}" for r in report_["risks"]]
    try:
        task = ctx.act(
            "tasks.create",
            {
                "title": f"Review {len(lines)} API compatibility risk(s): "
                f"{report_['old_spec']} → {report_['new_spec']}",
                "body": "\n".join(lines),
            },
            reason=review_reason(report_),
            target=f"{report_['new_spec']}",
        )
    except ActionRejected as rejected:
        # A reviewer said no: the report stands on its own, and the run records why.
        return Complete(update={"review_task": {"rejected": rejected.detail}})
    return Complete(update={"review_task": {"id": task.external_id, "action": task.action_id}})


@graph.on_revision
def keep_valid_evidence(
    old_state: dict[str, Any], old_goal: Any, new_goal: Any
) -> tuple[dict[str, Any], str]:
    """Evidence for prefixes still in scope (same specs) stays; the report and the rest go."""
    old_name, new_name = _specs(new_goal)
    wanted = {f"{old_name}..{new_name}:{prefix}" for prefix in new_goal["scope"]}
    kept = {k: v for k, v in old_state.get("evidence", {}).items() if k in wanted}
    return {"evidence": kept, "dropped": sorted(set(old_state.get("evidence", {})) - wanted)}, (
        "read_specs"
    )


register(graph)
