"""The hooks the executor, the dispatcher and the API call where a run is taken and advanced,
a step begins and ends, a call is recorded, an action goes through a phase, and a decision is
made: each feeds the metrics (runtime.metrics), binds what the log lines that follow are about
(runtime.logs) and opens the span of that moment (runtime.tracing). One call per site keeps
those three modules out of the runtime's code, and a new signal is added here, not at the sites.

Tracing off (the default), the span part of every hook is `runtime.tracing`'s shared no-op:
no span object, attribute dict or header is built (bench/run.py's `tracing` section measures
what is left).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

from runtime import logs, metrics, tracing

P = ParamSpec("P")
R = TypeVar("R")


def lease_taken(lease: Any) -> None:
    logs.bind_lease(lease.run_id, lease.tenant_id, lease.fence)


def advancing(run: Any) -> AbstractContextManager[Any]:
    """An executor's turn on `run`: the span its steps nest under, a child of the request
    that created the run (its stored `traceparent`), whichever process runs it."""
    return tracing.advance(run)


class Step:
    """One step's execution: `with` it around the step function (its span); `step_done`
    takes it once the step's outcome is committed (its duration)."""

    __slots__ = ("began", "_span")

    def __init__(self, ctx: Any, quiet: tuple[type[BaseException], ...]) -> None:
        logs.bind_action(None)  # a step starts: no action is in hand yet
        self._span = tracing.step(ctx, quiet)
        self.began = metrics.clock()

    def __enter__(self) -> Step:
        self._span.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._span.__exit__(kind, exc, tb)


def step_begins(ctx: Any, quiet: tuple[type[BaseException], ...] = ()) -> Step:
    """A step starts. An exception of a `quiet` type is how a step stops on purpose (a run
    parks for an approval): its span notes it instead of marking an error."""
    return Step(ctx, quiet)


def step_done(step: Step, ended: float | None = None) -> None:
    """The step's commit landed. `ended`: when its commit was sent, for one whose answer was
    taken later (during the next step: runtime.executor) — its duration ends there."""
    metrics.observe_step(step.began, ended)


class Sending:
    """The request for an action, `with` it around the tool's call: the log lines name the
    action, the send span is current (runtime.wire puts *its* traceparent on an HTTP
    tool's request), and a call that answered is timed."""

    __slots__ = ("action", "began", "_span")

    def __init__(self, action: Any) -> None:
        logs.bind_action(action.action_id)
        self.action = action
        self._span = tracing.send(action)
        self.began = 0.0

    def __enter__(self) -> Sending:
        self._span.__enter__()
        self.began = metrics.clock()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is None:
            metrics.observe_action(self.action.tool, self.began)
        self._span.__exit__(kind, exc, tb)


def sending(action: Any) -> Sending:
    """The request for `action` leaves now."""
    return Sending(action)


def answer_reported(action: Any, settled_from: str) -> None:
    """An external executor reported the answer of a `client` tool's request: `action` is
    the row as stored after it, `settled_from` its status before. Timed as a hosted tool's
    request is, from its `sent` mark to the outcome, both the database's times — only a
    report that settled a `sent` action with the service's answer (a repeat, a lookup or an
    `unknown` is no request's answer)."""
    if settled_from != "sent" or action.status not in ("confirmed", "failed"):
        return
    if action.sent_at is None or action.updated_at is None:
        return
    seconds = (action.updated_at - action.sent_at).total_seconds()
    metrics.observe_action_seconds(action.tool, seconds)


def recording(ctx: Any, key: str, kind: str) -> AbstractContextManager[Any]:
    """A `ctx.record` / `ctx.model` call (`kind`), paid or answered from the record
    (`tracing.reused` marks which)."""
    return tracing.call(ctx, key, kind)


def phase(
    name: str, subject: Callable[..., tuple[Any, Any, str]]
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorates the function of an action phase (prepare / outcome / reconcile): see
    `tracing.action_phase`. The send phase is `sending`, around the call itself."""
    return tracing.action_phase(name, subject)


def deciding(request: Any, action: Any, run: Any, verdict: str) -> AbstractContextManager[Any]:
    """A reviewer's vote on `action`: a span in the run's trace."""
    return tracing.decision(request, action, run, verdict)


def trace_context() -> str:
    """What a new run stores to continue this request's trace later ("" when off)."""
    return tracing.current_traceparent()


def reused(span: Any, value: bool) -> None:
    """Marks a `recording` span as answered from the record (True) or paid now (False)."""
    tracing.reused(span, value)
