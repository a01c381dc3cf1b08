"""A graph whose only step fails in the way its goal names, for step-failure tests.

`{"how": "not_json"}` returns an update that is not JSON (a datetime), `{"how": "raise"}`
raises, `{"how": "commit"}` returns a good update whose commit the database refuses (the
test takes the checkpoint rev first). Loaded by worker processes as a graph module.
"""

from __future__ import annotations

from datetime import UTC, datetime

from runtime.context import StepContext
from runtime.graphs import Complete, Graph, Next, Outcome, register

failing = Graph("failing", version="1", max_failures=3, retry_base=0.05, retry_max=0.2)


@failing.step(start=True)
def attempt(ctx: StepContext) -> Outcome:
    how = ctx.goal["how"]
    if how == "not_json":
        return Next("done", update={"when": datetime(2026, 12, 1, tzinfo=UTC)})
    if how == "raise":
        raise RuntimeError("the tracker said no")
    return Next("done", update={"fine": True})


@failing.step
def done(ctx: StepContext) -> Outcome:
    return Complete()


register(failing)


# Round trips (issue 16, L4): the goal's `state` becomes the run's state, the run waits, and
# after the input the next step — reading the state back from its checkpoint — keeps what
# it saw, stored once more.
echo = Graph("echo", version="1")


@echo.step(start=True)
def store(ctx: StepContext) -> Outcome:
    from runtime.graphs import Wait

    return Wait("input", then="read_back", update=dict(ctx.goal["state"]))


@echo.step
def read_back(ctx: StepContext) -> Outcome:
    return Complete(update={"seen": dict(ctx.state)})


register(echo)


# A step that outlives its graph's step_timeout: it sleeps for the goal's `sleep` seconds.
slow = Graph("slow", version="1", max_failures=3, step_timeout=0.3, retry_base=0.05, retry_max=0.2)


@slow.step(start=True)
def linger(ctx: StepContext) -> Outcome:
    import time

    time.sleep(ctx.goal["sleep"])
    return Next("done", update={"slept": ctx.goal["sleep"]})


@slow.step(name="done")
def slow_done(ctx: StepContext) -> Outcome:
    return Complete()


register(slow)
