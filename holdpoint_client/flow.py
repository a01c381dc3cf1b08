"""The executor's logic once, for a blocking and an asyncio agent alike ("sans-I/O").

What an external executor must do to act exactly once — prepare, wait for a reviewer,
dispatch, perform, reconcile, record — is subtle enough to exist in one copy only. It is
written as generators that *yield* what they need done (`Call`: an API call; `Sleep`: a
pause; `Invoke`: the agent's own function, e.g. `perform`) and get the answer sent back in
(or the exception thrown in, so `try`/`except` reads as in plain code). `drive` runs a flow
with `Client` and `time.sleep`; `adrive` with `AsyncClient`, `asyncio.sleep`, and awaits
what an agent's `async def` returns.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from holdpoint_client.calls import Call

T = TypeVar("T")


class Client(Protocol):
    """What `drive` needs of a client (`holdpoint_client.Client`): sending one call. A
    protocol, so this module stays below both clients."""

    def send(self, call: Call[T]) -> T: ...


class AsyncClient(Protocol):
    """What `adrive` needs of an asyncio client (`holdpoint_client.AsyncClient`)."""

    async def send(self, call: Call[T]) -> T: ...


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class Invoke:
    """Call a driver hook, or (`agents`) the agent's own function; an awaitable result is
    awaited by the asyncio driver."""

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    # The agent's function (perform, lookup, a recorded call): it may block for as long as
    # a model or a service takes, so the asyncio driver runs a plain one on a thread.
    agents: bool = False


Op = Call[Any] | Sleep | Invoke
Flow = Generator[Op, Any, T]


def ask(call: Call[T]) -> Flow[T]:
    """`value = yield from ask(calls.get_run(...))`: one API call, typed."""
    answer: T = yield call
    return answer


def invoke(fn: Callable[..., Any], *args: Any) -> Flow[Any]:
    """A driver hook (heartbeats on, off): called where the driver runs."""
    return (yield Invoke(fn, args))


def call_agent(fn: Callable[..., Any], *args: Any) -> Flow[Any]:
    """The agent's own function (`perform`, `lookup`, a recorded call), which may block."""
    return (yield Invoke(fn, args, agents=True))


def refuse_async(*fns: Callable[..., Any] | None) -> None:
    """At a blocking entry point, before any request: an `async def` function of the agent
    (or an object whose `__call__` is one) cannot be awaited there. Found only when called
    — after the action was marked `sent` — its TypeError read as an outcome nobody knows,
    and the server had a never-attempted effect replayed, then handed to a person."""
    for fn in fns:
        if fn is not None and (
            inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)
        ):
            raise TypeError(f"{fn!r} is async: use AsyncHoldpoint / AsyncExecutor")


def pause(seconds: float) -> Flow[None]:
    yield Sleep(seconds)


def drive(flow: Flow[T], client: Client, sleep: Callable[[float], None] = time.sleep) -> T:
    """Run a flow to its end with blocking I/O."""
    value: Any = None
    error: Exception | None = None
    while True:
        try:
            op = flow.throw(error) if error is not None else flow.send(value)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        value, error = None, None
        try:
            if isinstance(op, Call):
                value = client.send(op)
            elif isinstance(op, Sleep):
                sleep(op.seconds)
            else:
                value = op.fn(*op.args)
                if inspect.isawaitable(value):
                    raise TypeError(f"{op.fn!r} is async: use AsyncHoldpoint / AsyncExecutor")
        except Exception as exc:  # thrown into the flow, which decides what it means
            error = exc


async def adrive(flow: Flow[T], client: AsyncClient) -> T:
    """Run a flow to its end on the event loop."""
    value: Any = None
    error: Exception | None = None
    while True:
        try:
            op = flow.throw(error) if error is not None else flow.send(value)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        value, error = None, None
        try:
            if isinstance(op, Call):
                value = await client.send(op)
            elif isinstance(op, Sleep):
                await asyncio.sleep(op.seconds)
            elif op.agents and not inspect.iscoroutinefunction(op.fn):
                value = await _on_a_thread(op.fn, op.args)
                if inspect.isawaitable(value):
                    value = await value
            else:
                value = op.fn(*op.args)
                if inspect.isawaitable(value):
                    value = await value
        except Exception as exc:
            error = exc


async def _on_a_thread(fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """A plain function of the agent, off the event loop: on the loop it would stop the
    heartbeat task for as long as it runs (a model call longer than the lease, and the lease
    lapses), where the blocking driver's heartbeat thread goes on. Cancelled, it still waits
    for the call to end, as a call on the loop would: the lease is not given up under it."""
    running = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        await asyncio.wait([running])
        raise
