"""A graph that files one tracker task, in two versions, for migration tests.

Worker processes load one version through HOLDPOINT_GRAPH_MODULES: `tests.runtime.filer_v1`
(version 1 only) before the "deploy", `tests.runtime.filer_v2` (version 2 and the migration
1 → 2, nothing of version 1) after it.
"""

from __future__ import annotations

from typing import Any

from runtime.context import StepContext
from runtime.graphs import Complete, Graph, Next, Outcome


def filer(version: str) -> Graph:
    graph = Graph("filer", version=version, tools=("tasks.create",), retry_base=0.05, retry_max=0.2)

    @graph.step(start=True)
    def draft(ctx: StepContext) -> Outcome:
        return Next("file", update={"title": f"Review {ctx.goal['what']}"})

    @graph.step
    def file(ctx: StepContext) -> Outcome:
        task = ctx.act(
            "tasks.create",
            {"title": ctx.state["title"], "body": "filed once"},
            reason="asked to file it",
        )
        return Complete(
            update={
                "task": task.external_id,
                "finished_on": version,
                "shape": ctx.state.get("shape", 1),
            }
        )

    return graph


def migrate_1_to_2(state: dict[str, Any]) -> dict[str, Any]:
    """Version 2 reads `shape`, which version 1 never wrote."""
    return {**state, "shape": 2}
