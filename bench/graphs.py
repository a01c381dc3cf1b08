"""Graphs the benchmark runs (loaded through HOLDPOINT_GRAPH_MODULES by bench/run.py).

`bench-noop`: one step that goes to itself until `state["i"]` reaches `goal["steps"]`, then
completes. It records no calls and proposes nothing, so each step costs exactly what the
engine adds: one durable commit (run-row CAS + checkpoint + journal append).
"""

from __future__ import annotations

from runtime.context import StepContext
from runtime.graphs import Complete, Graph, Next, Outcome, register

noop = Graph(
    "bench-noop",
    version="1",
    description="Benchmark: a no-op step repeated goal['steps'] times.",
    default_goal={"steps": 50},
)


@noop.step(start=True)
def tick(ctx: StepContext) -> Outcome:
    i = ctx.state.get("i", 0) + 1
    if i >= int(ctx.goal.get("steps", 50)):
        return Complete(update={"i": i})
    return Next("tick", update={"i": i})


register(noop)
