"""Graphs the benchmark runs (loaded through HOLDPOINT_GRAPH_MODULES by bench/run.py).

`bench-noop`: one step that goes to itself until `state["i"]` reaches `goal["steps"]`, then
completes. It records no calls and proposes nothing, so each step costs exactly what the
engine adds: one durable commit (run-row CAS + checkpoint + journal append).

`bench-act`: one `ctx.act("tasks.create", {"title": f"bench {i}"})` per step for
`goal["steps"]` steps, then completes: each step costs the ledger's writes around one HTTP
side effect plus the step commit (bench/ledger.py measures it against the bare call).

`bench-grow`: like bench-noop, but every step appends one kilobyte (`kilobyte()`, the same
strings LangGraph's chain appends in bench/peers.py) to `state["log"]`: what storing a state
that grows costs (bench/storage.py).

`bench-slow`: a step that works `goal["sleep"]` seconds, repeated: a long run to kill a worker
in the middle of (bench/recovery.py).

`bench-hold`: one `tasks.create` that an approval policy holds: the run parks at its hold
point with a pending approval request (bench/pages.py).
"""

from __future__ import annotations

import hashlib
import time

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


# --- bench-grow: a state growing by one kilobyte per step -------------------------------------
def kilobyte(seed: str, i: int) -> str:
    """1,024 ASCII characters that differ for every (seed, i) and do not compress (hex of
    sha256): neither Holdpoint's artifacts nor a saver's blobs can shrink them."""
    parts = [hashlib.sha256(f"{seed}:{i}:{k}".encode()).hexdigest() for k in range(16)]
    return "".join(parts)


grow = Graph(
    "bench-grow",
    version="1",
    description="Benchmark: appends one kilobyte to state['log'] per step, goal['steps'] times.",
    default_goal={"steps": 50, "seed": "bench"},
)


@grow.step(start=True)
def append_kilobyte(ctx: StepContext) -> Outcome:
    i = ctx.state.get("i", 0) + 1
    log = [*ctx.state.get("log", []), kilobyte(str(ctx.goal.get("seed", "bench")), i)]
    if i >= int(ctx.goal.get("steps", 50)):
        return Complete(update={"i": i, "log": log})
    return Next("append_kilobyte", update={"i": i, "log": log})


register(grow)


# --- bench-slow: a long run whose steps take a while ---------------------------------------
slow = Graph(
    "bench-slow",
    version="1",
    description="Benchmark: a step that works goal['sleep'] seconds, goal['steps'] times.",
    default_goal={"steps": 100_000, "sleep": 0.05},
)


@slow.step(start=True)
def work(ctx: StepContext) -> Outcome:
    time.sleep(float(ctx.goal.get("sleep", 0.05)))
    i = ctx.state.get("i", 0) + 1
    if i >= int(ctx.goal.get("steps", 100_000)):
        return Complete(update={"i": i})
    return Next("work", update={"i": i})


register(slow)


# --- bench-hold: one held action ------------------------------------------------------------
hold = Graph(
    "bench-hold",
    version="1",
    tools=("tasks.create",),
    description="Benchmark: one tasks.create that an approval policy holds.",
    default_goal={"title": "Review the bench change"},
)


@hold.step(start=True)
def ask(ctx: StepContext) -> Outcome:
    ctx.act(
        "tasks.create",
        {"title": str(ctx.goal.get("title", "Review the bench change"))},
        reason="The benchmark asks a reviewer: **hold point** with a pending request.",
        target=str(ctx.goal.get("target", "bench-service")),
    )
    return Complete()


register(hold)
