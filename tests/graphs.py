"""Graphs the tests run, in-process and in real worker processes.

`chain` appends one line per step execution and per paid call to the file named in its
goal, so a test can count executions across processes and crashes.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from runtime.context import StepContext
from runtime.graphs import Complete, Graph, Next, Outcome, Wait, register
from runtime.tools import CallResult, Tool, register_tool


def _note(ctx: StepContext, line: str) -> None:
    path = ctx.goal.get("counter")
    if path:
        with open(path, "a") as out:
            out.write(f"{ctx.run_id} {line} pid={os.getpid()}\n")


chain = Graph("chain", version="1", max_failures=3, retry_base=0.05, retry_max=0.2)


@chain.step(start=True)
def tick(ctx: StepContext) -> Outcome:
    i = ctx.state.get("i", 0) + 1
    _note(ctx, f"step {i}")
    answer = ctx.model("think", lambda: (_note(ctx, f"call {i}"), f"thought {i}")[1])
    if ctx.goal.get("sleep"):
        time.sleep(float(ctx.goal["sleep"]))
    update = {"i": i, "answers": [*ctx.state.get("answers", []), answer]}
    if i >= int(ctx.goal.get("steps", 3)):
        return Complete(update=update)
    return Next("tick", update=update)


register(chain)

FAILURES: Counter[str] = Counter()
flaky = Graph("flaky", version="1", max_failures=3, retry_base=30.0, retry_max=120.0)


@flaky.step(start=True)
def attempt(ctx: StepContext) -> Outcome:
    FAILURES[str(ctx.run_id)] += 1
    if FAILURES[str(ctx.run_id)] <= int(ctx.goal.get("fail_times", 0)):
        raise RuntimeError(f"tool unavailable (attempt {FAILURES[str(ctx.run_id)]})")
    return Complete(update={"attempts_seen": FAILURES[str(ctx.run_id)]})


register(flaky)

asker = Graph("asker", version="1")


@asker.step(start=True)
def ask(ctx: StepContext) -> Outcome:
    return Wait("input", then="answer", prompt="What is the ticket title?")


@asker.step
def answer(ctx: StepContext) -> Outcome:
    return Complete(update={"title": ctx.input["title"]})


register(asker)


class NoteTool(Tool):
    """A local tool for tests: applies at once, with a synthetic id."""

    def call(self, params_text: str, *, key: str, fence: int, run_id: str) -> CallResult:
        return CallResult("applied", external_id=f"note-{key}", result={"params": params_text})


register_tool(NoteTool(name="test.note", approval=True, schema={"type": "object"}))

proposer = Graph("proposer", version="1", tools=("test.note",))


@proposer.step(start=True)
def propose(ctx: StepContext) -> Outcome:
    note = ctx.act("test.note", {"title": ctx.goal["title"]}, reason="asked to")
    return Complete(update={"done_for": ctx.goal["title"], "note": note.external_id})


register(proposer)

grower = Graph("grower", version="1")


@grower.step(start=True)
def grow(ctx: StepContext) -> Outcome:
    notes = [*ctx.state.get("notes", []), "x" * 1000 + str(len(ctx.state.get("notes", [])))]
    if len(notes) >= int(ctx.goal["steps"]):
        return Complete(update={"notes": notes})
    return Next("grow", update={"notes": notes})


register(grower)

# The same notes as `grower` (so the same artifacts in a tenant), then a wait for input: a
# run that is not finished — the retention purge must keep it, and what it refers to.
patient_grower = Graph("patient_grower", version="1")


@patient_grower.step(start=True)
def grow_then_ask(ctx: StepContext) -> Outcome:
    notes = [*ctx.state.get("notes", []), "x" * 1000 + str(len(ctx.state.get("notes", [])))]
    if len(notes) >= int(ctx.goal["steps"]):
        return Wait("input", then="take_answer", update={"notes": notes}, prompt="And then?")
    return Next("grow_then_ask", update={"notes": notes})


@patient_grower.step
def take_answer(ctx: StepContext) -> Outcome:
    return Complete(update={"answer": ctx.input})


register(patient_grower)


def evolving(version: str) -> Graph:
    """A graph that exists in several versions (tests register/unregister them)."""
    graph = Graph("evolving", version=version)

    @graph.step(start=True)
    def first(ctx: StepContext) -> Outcome:
        return Wait("input", then="second", update={"shape": version})

    @graph.step
    def second(ctx: StepContext) -> Outcome:
        return Complete(update={"finished_on": version, "seen": dict(ctx.state)})

    return graph


def reviser_goal(**extra: Any) -> dict[str, Any]:
    return {"title": "first", **extra}


# A graph on a tool that is not built in: the tenant defines `tickets.create` (a tracker
# that is not tasks.*) and the graph only names it; the goal carries the ticket.
ticketing = Graph("ticketing", version="1", max_failures=3, retry_base=0.05, retry_max=0.2)


@ticketing.step(start=True)
def file_ticket(ctx: StepContext) -> Outcome:
    ticket = ctx.act(
        ctx.goal.get("tool", "tickets.create"),
        {"title": ctx.goal["title"]},
        reason="the goal asks for a ticket",
    )
    return Next("report", update={"ticket": ticket.external_id})


@ticketing.step
def report(ctx: StepContext) -> Outcome:
    # A second step, so a worker's first step commit is never the run's last (the crash
    # matrix kills it at after_checkpoint while the run is still running).
    return Complete(update={"reported": ctx.state["ticket"]})


register(ticketing)

# The same tickets filed by a run's second step: a worker's first commit of an execution is a
# transaction (it reads the journal's head), the ones after it single statements on PostgreSQL
# — where an action's prepare is one statement too. `tickets` of them in one step (1 unless the
# goal says), with whatever the test puts in BETWEEN_TICKETS done between the first two (a
# redefinition of the tool, say): the first one's confirmation rides on the second's prepare.
BETWEEN_TICKETS: list[Callable[[], None]] = []
ticketing_later = Graph("ticketing-later", version="1")


@ticketing_later.step(start=True)
def begin(ctx: StepContext) -> Outcome:
    return Next("file_later")


@ticketing_later.step
def file_later(ctx: StepContext) -> Outcome:
    count, title, ids = int(ctx.goal.get("tickets", 1)), ctx.goal["title"], []
    for n in range(1, count + 1):
        while n == 2 and BETWEEN_TICKETS:
            BETWEEN_TICKETS.pop(0)()
        params = {"title": title if count == 1 else f"{title} {n}"}
        ticket = ctx.act(ctx.goal.get("tool", "tickets.create"), params, reason="the goal")
        ids.append(ticket.external_id)
    return Complete(update={"tickets": ids})


register(ticketing_later)
