"""Graphs the benchmark runs (loaded through HOLDPOINT_GRAPH_MODULES by bench/run.py).

`bench-noop`: one step that goes to itself until `state["i"]` reaches `goal["steps"]`, then
completes. It records no calls and proposes nothing, so each step costs exactly what the
engine adds: one durable commit (run-row CAS + checkpoint + journal append).

`bench-act`: one `ctx.act("tasks.create", {"title": f"bench {i}"})` per step for
`goal["steps"]` steps, then completes: each step costs the ledger's writes around one HTTP
side effect plus the step commit (bench/ledger.py measures it against the bare call).
"""

from __future__ import annotations

from runtime.context import StepContext
from runtime.graphs import Complete, Fail, Graph, Next, Outcome, register

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


# The idempotency key of an action is run:goal_rev:step:call_index, with no notion of how
# often the step was visited: a step that loops to itself and acts on every visit gets the
# first visit's key again (refused as "different params under the same idempotency key", or,
# with equal params, answered with the first visit's proof). So bench-act names each visit:
# the same step function registered as act_1 … act_{MAX_ACT_STEPS}, each going to the next.
MAX_ACT_STEPS = 1000

act = Graph(
    "bench-act",
    version="1",
    tools=("tasks.create",),
    description="Benchmark: one tasks.create action per step, goal['steps'] times.",
    default_goal={"steps": 20},
)


def act_once(ctx: StepContext) -> Outcome:
    i = ctx.state.get("i", 0) + 1
    steps = int(ctx.goal.get("steps", 20))
    if steps > MAX_ACT_STEPS:
        return Fail(f"bench-act runs at most {MAX_ACT_STEPS} steps")
    ctx.act("tasks.create", {"title": f"bench {i}"})
    if i >= steps:
        return Complete(update={"i": i})
    return Next(f"act_{i + 1}", update={"i": i})


for _k in range(1, MAX_ACT_STEPS + 1):
    act.step(act_once, name=f"act_{_k}", start=_k == 1)

register(act)
