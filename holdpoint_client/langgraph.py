"""LangGraph / LangChain 1.x: each tool call of an agent is a Holdpoint action.

    hg = HoldpointGraph(Holdpoint.from_env(), graph="api-review")

    @hg.action("agent.tasks.create")
    @tool
    def create_task(title: str) -> dict:
        "Create a task in the tracker."
        return httpx.post(TASKS, json={"title": title}, headers=current_call().headers()).json()

    builder.add_node("tools", hg.tool_node([create_task]))   # or ToolNode(..., wrap_tool_call=hg)
    result = hg.invoke(app, {"messages": [...]}, {"configurable": {"thread_id": "review-42"}})

Why it is shaped so:

- A LangGraph node re-runs from its first line after a crash or a resume, and the model's
  `tool_call_id` is checkpointed before the tool node runs. The action's label is
  `lc:<tool_call_id>` inside the run of the LangGraph thread, so a re-run meets the action
  its predecessor prepared — waiting, approved, sent or confirmed — and continues it; the
  tool is never called for it again once its outcome is recorded.
- A hold point pauses the graph with LangGraph's own `interrupt()`, carrying the approval
  (id, action hash, expiry, the request page's link). The resume value is never trusted:
  on resume the node asks Holdpoint again, and what runs is the *approved* params (a
  reviewer's edits included); a rejection becomes the tool's message with the reviewer's
  reason, so the model sees it. A forged `Command(resume={"approved": True})` approves
  nothing: a still pending approval is waited for (long-poll) instead. The held calls of
  one model message are asked in one interrupt listing them all (`calls`): ToolNode runs
  them in one LangGraph task, which can show only one interrupt at a time.
- The Holdpoint run's lease is held only while a call is being settled, so several
  processes may resume one thread at once: the lease's fence lets one of them act, the
  other finds the recorded outcome. LangGraph's checkpointer is untouched — any saver works.
- An unknown outcome (the tool raised, the process died after the call) is settled as the
  server's `reconcile` says for the tool (`run.act` does it): the call again with the same
  Idempotency-Key, the tool's `lookup`, or a person.

- An asyncio graph (`ainvoke`, `astream`, `async def` tools) is ledgered the same way by
  `awrap_tool_call`, with an `AsyncHoldpoint`: what to ask, settle and answer is written
  once as flows (holdpoint_client.flow), driven with blocking calls or on the event loop.

Only the tools named with `action()` are ledgered; the others run as before. Imported only
by agents that use LangGraph: `import holdpoint_client` never imports it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

from langchain_core.messages import ToolCall as LangChainToolCall
from langchain_core.messages import ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool
from langgraph.errors import GraphBubbleUp, GraphInterrupt
from langgraph.prebuilt import ToolNode
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import Command, StateSnapshot, interrupt

from holdpoint_client import calls
from holdpoint_client.agent import AsyncHoldpoint, Holdpoint, Proof, RunCore
from holdpoint_client.errors import (
    ActionFailed,
    ActionWithdrawn,
    ApprovalTimeout,
    ExecutorError,
    Rejected,
)
from holdpoint_client.faults import fault
from holdpoint_client.flow import Flow, adrive, ask, drive, invoke, refuse_async
from holdpoint_client.langgraph_parts import (
    _STOP,
    _TOOL_NODE_DEFAULT,
    KIND,
    MAX_BATCHES,
    SENT,
    TURN,
    Batch,
    OlderGoal,
    Spec,
    _answer,
    _call,
    _dumps,
    _fits,
    _in_artifact,
    _interrupts,
    _latest_ai_message,
    _message,
    _ours,
    _reason,
    _sparing_the_ledger,
    _with_artifact,
    answered,
    current_call,
    decision,
    not_of_an_older_goal,
    request_page,
    thread_of,
)
from holdpoint_client.models import Action
from holdpoint_client.toolcall import ToolCall

T = TypeVar("T", bound=BaseTool)
R = TypeVar("R")
Execute = Callable[[ToolCallRequest], ToolMessage | Command[Any]]
AsyncExecute = Callable[[ToolCallRequest], Awaitable[ToolMessage | Command[Any]]]
Body = Callable[[RunCore[Any]], Flow[R]]


class HoldpointGraph:
    """Holdpoint for one LangGraph agent: which tools are ledgered, and as what.

    `hp` is a `Holdpoint` for a graph run with `invoke`/`stream`, an `AsyncHoldpoint` for
    one run with `ainvoke`/`astream` (then `ainvoke` drives a thread; one per event loop).
    `graph` names the agent in Holdpoint (the run's graph); `goal` is the run's goal when the
    first ledgered call of a thread creates it. `approval_timeout` bounds the wait for a
    reviewer after a resume (None: as long as it takes; the lease is renewed meanwhile).
    """

    def __init__(
        self,
        hp: Holdpoint | AsyncHoldpoint,
        *,
        graph: str,
        goal: Any = None,
        approval_timeout: float | None = None,
    ) -> None:
        self.hp = hp
        self.graph = graph
        self.goal = goal
        self.approval_timeout = approval_timeout
        self.specs: dict[str, Spec] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._alocks: dict[str, asyncio.Lock] = {}
        self._guard = threading.Lock()
        self._batches: dict[tuple[str, int], Batch] = {}

    # --- declaring -------------------------------------------------------------------------

    def action(
        self,
        tool: str,
        *,
        reason: str | Callable[[dict[str, Any]], str] | None = None,
        lookup: Callable[[ToolCall], Any] | None = None,
        external_id: Proof = "id",
    ) -> Callable[[T], T]:
        """Ledger the LangChain tool under Holdpoint's tool `tool` (put it above `@tool`).

        `reason` (a string, or a function of the params) is what the reviewer reads; by
        default the model's text before the call, else the tool's description. `lookup(call)`
        finds the effect by `call.idempotency_key` for a tool Holdpoint reconciles by lookup
        (the service's answer, or None; an `async def` one with an AsyncHoldpoint).
        `external_id` is the answer's key holding the proof (or a function of the answer).
        The tool itself is returned unchanged.
        """

        def register(fn: T) -> T:
            self.specs[fn.name] = Spec(tool, reason, lookup, external_id)
            return fn

        return register

    def tool_node(self, tools: Sequence[BaseTool | Callable[..., Any]], **options: Any) -> ToolNode:
        """A `ToolNode` running `tools`, the ledgered ones through Holdpoint, for `invoke`
        and `ainvoke` alike (`wrap_tool_call` and `awrap_tool_call`).

        `handle_tool_errors` applies to the tools' own errors only. What the ledger raises
        for a ledgered call (OutcomeUnknown, LeaseLost, Holdpoint unreachable, ...) stops
        the graph whatever it says: the ToolNode would tell it to the model as an error,
        and the model would ask again under a new call id — a new action, and the effect
        twice."""
        flag = options.get("handle_tool_errors", _TOOL_NODE_DEFAULT)
        options["handle_tool_errors"] = _sparing_the_ledger(flag)
        return ToolNode(tools, wrap_tool_call=self, awrap_tool_call=self.awrap_tool_call, **options)

    def middleware(self) -> Any:
        """For `langchain.agents.create_agent(..., middleware=[hg.middleware()])`: the same
        wrapping in the agent's tool-call position (needs the `langchain` package)."""
        from langchain.agents.middleware import AgentMiddleware

        outer = self

        class HoldpointMiddleware(AgentMiddleware):  # type: ignore[misc]
            """Holdpoint in the tool-call position of a `create_agent` agent."""

            def wrap_tool_call(
                self, request: ToolCallRequest, handler: Execute
            ) -> ToolMessage | Command[Any]:
                return outer(request, handler)

            async def awrap_tool_call(
                self, request: ToolCallRequest, handler: AsyncExecute
            ) -> ToolMessage | Command[Any]:
                return await outer.awrap_tool_call(request, handler)

        return HoldpointMiddleware()

    # --- one tool call ---------------------------------------------------------------------

    def __call__(self, request: ToolCallRequest, execute: Execute) -> ToolMessage | Command[Any]:
        """The `wrap_tool_call` of a ToolNode: a ledgered tool's call becomes an action."""
        spec = self.specs.get(request.tool_call["name"])
        if spec is None or not _fits(request.tool, request.tool_call):
            return execute(request)  # not ledgered, or the node reports the bad arguments
        paired = _with_artifact(request)

        def perform(call: ToolCall) -> Any:
            token = _call.set(call)
            try:
                return _answer(execute(_approved(request, call)), paired)
            finally:
                _call.reset(token)

        try:
            hp = self._blocking()
            refuse_async(spec.lookup)
            return drive(self._ledgered(request, spec, perform), hp.client)
        except GraphBubbleUp:
            raise  # an interrupt: the graph pauses at the hold point
        except Exception as exc:
            setattr(exc, _STOP, True)  # not the tool's error: see `tool_node`
            raise

    async def awrap_tool_call(
        self, request: ToolCallRequest, execute: AsyncExecute
    ) -> ToolMessage | Command[Any]:
        """The `awrap_tool_call` of a ToolNode (`ainvoke`, `astream`): `__call__` on the
        event loop — the same flow, the tool awaited (an `async def` tool included)."""
        spec = self.specs.get(request.tool_call["name"])
        if spec is None or not _fits(request.tool, request.tool_call):
            return await execute(request)
        paired = _with_artifact(request)

        async def perform(call: ToolCall) -> Any:
            token = _call.set(call)
            try:
                return _answer(await execute(_approved(request, call)), paired)
            finally:
                _call.reset(token)

        try:
            return await adrive(self._ledgered(request, spec, perform), self._asyncio().client)
        except GraphBubbleUp:
            raise
        except Exception as exc:
            setattr(exc, _STOP, True)
            raise

    def _blocking(self) -> Holdpoint:
        """The blocking client, refused on an event loop: there a ToolNode without
        `awrap_tool_call` falls back to `wrap_tool_call`, which would stall the loop and run
        an `async def` tool through LangChain's sync path — which refuses it after the
        action is marked `sent`: a call never attempted, read as an unknown outcome."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            if isinstance(self.hp, Holdpoint):
                return self.hp
            raise ExecutorError(
                "HoldpointGraph(AsyncHoldpoint) ledgers an asyncio graph: run it with "
                "ainvoke/astream"
            ) from None
        raise ExecutorError(
            "a graph run on an event loop (ainvoke/astream) needs HoldpointGraph(AsyncHoldpoint"
            "(...)) and a ToolNode with awrap_tool_call (hg.tool_node does both)"
        )

    def _asyncio(self) -> AsyncHoldpoint:
        if isinstance(self.hp, AsyncHoldpoint):
            return self.hp
        raise ExecutorError(
            "a graph run with ainvoke/astream needs HoldpointGraph(AsyncHoldpoint(...)): "
            "a blocking Holdpoint would stall the event loop"
        )

    def _ledgered(
        self, request: ToolCallRequest, spec: Spec, perform: Callable[[ToolCall], Any]
    ) -> Flow[ToolMessage]:
        """One ledgered tool call, settled by the ledger or paused at its hold point: the
        same flow for both drivers (`perform` runs the tool as the driver can)."""
        tool_call = request.tool_call
        thread = thread_of(request.runtime.config if request.runtime is not None else None)
        params = dict(tool_call["args"])
        paired = _with_artifact(request)
        label = f"lc:{tool_call['id']}"

        def act(approval_timeout: float | None) -> Flow[Any]:
            def body(run: RunCore[Any]) -> Flow[Any]:
                yield from not_of_an_older_goal(run, label)
                return (
                    yield from run._act(
                        spec.tool,
                        params,
                        reason=_reason(spec, request.state, request.tool, params),
                        perform=perform,
                        lookup=spec.lookup,
                        label=label,
                        external_id=_in_artifact(spec.external_id) if paired else spec.external_id,
                        approval_timeout=approval_timeout,
                    )
                )

            return self._holding(thread, body)

        batch = self._batch(request, tool_call)
        try:
            # Every hold point of the node's calls, asked together before any is settled:
            # raises GraphInterrupt (the graph pauses, the checkpointer keeps it) unless
            # this is a resume; then each decision is read from Holdpoint, not from it.
            yield from self._ask(batch, request, thread)
            try:
                result = yield from act(0)  # settled, or held: never blocks on a reviewer here
            except ApprovalTimeout as held:
                if str(tool_call["id"]) not in batch.surfaced:  # held anew, at its dispatch
                    value = yield from self._pending(held.action, thread, str(tool_call["id"]))
                    yield from invoke(batch.lock.acquire)
                    try:
                        interrupt(value)
                    finally:
                        batch.lock.release()
                result = yield from act(self.approval_timeout)
        except Rejected as no:
            return _message(request, f"A reviewer rejected {spec.tool}: {no.reason}", "error")
        except OlderGoal as older:
            again = " again" if older.may_have_run else ""
            return _message(request, f"{spec.tool} was not run{again}: {older}", "error")
        except (ActionWithdrawn, ActionFailed) as gone:
            return _message(request, f"{spec.tool} did not run: {gone}", "error")
        finally:
            self._leave(batch)
        if paired and isinstance(result, Mapping) and "content" in result:
            return _message(request, result["content"], artifact=result.get("artifact"))
        return _message(request, result if isinstance(result, str) else _dumps(result))

    # --- the thread's run, held while a call is settled ------------------------------------

    def _holding(self, thread: str, body: Body[R], *, complete: bool = False) -> Flow[R]:
        """`body` run in the thread's Holdpoint run, its lease held meanwhile — by the
        driver's own context manager (`with`, `async with`), so that the lease is let go
        (and its heartbeat stopped) however the body ends."""
        hold = self._ahold if isinstance(self.hp, AsyncHoldpoint) else self._hold
        return cast(R, (yield from invoke(hold, thread, body, complete)))

    def _hold(self, thread: str, body: Body[R], complete: bool) -> R:
        """One call at a time per thread in this process: ToolNode runs a message's tool
        calls in parallel threads (tasks), and they share one lease owner."""
        with self._guard:
            lock = self._locks.setdefault(thread, threading.Lock())
        hp = cast(Holdpoint, self.hp)
        with lock, hp.run(thread, graph=self.graph, goal=self.goal, complete=complete) as run:
            return drive(body(run), run.client)

    async def _ahold(self, thread: str, body: Body[R], complete: bool) -> R:
        with self._guard:
            lock = self._alocks.setdefault(thread, asyncio.Lock())
        hp = cast(AsyncHoldpoint, self.hp)
        async with lock, hp.run(thread, graph=self.graph, goal=self.goal, complete=complete) as run:
            return await adrive(body(run), run.client)

    # --- the hold points of the calls one tool node runs together ----------------------------

    def _batch(self, request: ToolCallRequest, tool_call: LangChainToolCall) -> Batch:
        """The batch of this run of the tool node, shared by the threads (tasks) of its
        calls: the node's input (`request.state`, the same object for each call of one run,
        a new one for the next run) in its LangGraph task (`checkpoint_ns`)."""
        members = self._members(request, tool_call)
        config = request.runtime.config if request.runtime is not None else {}
        key = (str((config.get("configurable") or {}).get("checkpoint_ns", "")), id(request.state))
        with self._guard:
            found = self._batches.get(key)
            if found is None or found.state is not request.state:
                lock = asyncio.Lock() if isinstance(self.hp, AsyncHoldpoint) else threading.Lock()
                found = self._batches[key] = Batch(key, request.state, len(members), lock=lock)
                while len(self._batches) > MAX_BATCHES:  # a run some call never finished
                    del self._batches[next(iter(self._batches))]
            found.members = found.members or members
            return found

    def _leave(self, batch: Batch) -> None:
        with self._guard:
            batch.left -= 1
            if batch.left <= 0 and self._batches.get(batch.key) is batch:
                del self._batches[batch.key]

    def _members(
        self, request: ToolCallRequest, tool_call: LangChainToolCall
    ) -> tuple[LangChainToolCall, ...]:
        """The ledgered calls this run of the node settles with this one: those of the
        model's latest message, as ToolNode runs them in one task — or only this one in a
        task LangGraph started for it alone (a `Send`, as `create_agent` makes one per
        call), whose interrupt LangGraph shows beside the others' anyway."""
        own = (tool_call,)
        config = request.runtime.config if request.runtime is not None else {}
        triggers = (config.get("metadata") or {}).get("langgraph_triggers") or ()
        if any(str(t).startswith(SENT) for t in triggers):
            return own
        message = _latest_ai_message(request.state)
        calls = tuple(message.tool_calls) if message is not None else ()
        if tool_call["id"] not in {c["id"] for c in calls}:
            return own
        tools = {t.name: t for t in getattr(request.runtime, "tools", None) or ()}
        return tuple(c for c in calls if c["name"] in self.specs and _fits(tools.get(c["name"]), c))

    def _ask(self, batch: Batch, request: ToolCallRequest, thread: str) -> Flow[None]:
        """Ask the hold points of the batch's calls, once per run of the node, before any
        is settled — in one interrupt listing every held call (LangChain's
        HumanInTheLoopMiddleware asks a message's calls so). LangGraph shows one interrupt
        of a task at a time and hands the task's answers out in the order its interrupts
        are asked: asked from each call's thread, the others would surface only after the
        first was answered, and its answer could go to another call's thread. So one thread
        asks for all; every thread of the batch pauses with that interrupt."""
        yield from invoke(batch.lock.acquire)  # the driver's lock: awaited on the loop
        try:
            if not batch.asked:
                pending = yield from self._held(batch, request, thread)
                batch.asked = True
                if pending:
                    fault("awaiting_approval")  # held durably; the graph is about to pause
                try:
                    while pending:
                        answer = interrupt({**pending[0], "calls": pending})
                        batch.surfaced |= {p["tool_call_id"] for p in pending}
                        named = answered(answer)
                        pending = [p for p in pending if named and p["approval_id"] not in named]
                except GraphInterrupt as paused:
                    batch.interrupted = tuple(paused.args[0])
        finally:
            batch.lock.release()
        if batch.interrupted:
            raise GraphInterrupt(batch.interrupted)

    def _held(
        self, batch: Batch, request: ToolCallRequest, thread: str
    ) -> Flow[list[dict[str, Any]]]:
        """The interrupt values of the batch's calls held for a reviewer: each call's action
        found or prepared (nothing is sent), in the model's order. A call of an older goal
        revision is left to its own thread, which tells the model."""
        tools = {t.name: t for t in getattr(request.runtime, "tools", None) or ()}

        def body(run: RunCore[Any]) -> Flow[list[tuple[Action, str]]]:
            held: list[tuple[Action, str]] = []
            if run.finished:
                return held  # every call is answered from the record
            for call in batch.members:
                label = f"lc:{call['id']}"
                try:
                    yield from not_of_an_older_goal(run, label)
                except OlderGoal:
                    continue
                spec, params = self.specs[call["name"]], dict(call["args"])
                why = _reason(spec, request.state, tools.get(call["name"]), params)
                action = yield from run.ex.find_or_prepare(spec.tool, params, label, why)
                if action.status == "awaiting_approval":
                    held.append((action, str(call["id"])))
            return held

        pending = []
        for action, call_id in (yield from self._holding(thread, body)):
            pending.append((yield from self._pending(action, thread, call_id)))
        return pending

    def _pending(self, action: Action, thread: str, tool_call_id: str) -> Flow[dict[str, Any]]:
        """The interrupt's value: what a person or a resumer needs to find the decision."""
        if action.approval is None:  # raised with the hold, so read again it is there
            action = yield from ask(calls.get_action(action.action_id))
        approval = yield from ask(calls.get_approval(str(action.approval)))
        return {
            "type": KIND,
            "approval_id": approval.id,
            "action_id": action.action_id,
            "action_hash": approval.action_hash,
            "expires_at": approval.expires_at.isoformat() if approval.expires_at else None,
            "url": request_page(self.hp, approval.id),
            "tool": action.tool,
            "params": action.params,
            "run_id": action.run_id,
            "thread_id": thread,
            "tool_call_id": tool_call_id,
        }

    # --- driving a thread ------------------------------------------------------------------

    def invoke(
        self,
        graph: Any,
        input: Any,
        config: RunnableConfig,
        *,
        timeout: float | None = None,
        complete: bool = True,
        turn: str | None = None,
        **options: Any,
    ) -> Any:
        """Start the thread with `input`, or continue it where it stopped (a crash, a hold
        point), waiting for reviewers (long-poll) and resuming with their decisions until
        the graph ends; then the Holdpoint run is completed (`complete=False`: left open,
        for a conversation's next turn). A thread that already ended is not run again —
        unless `turn` names a turn it has not taken: see `_fresh`. Returns the graph's last
        values; an interrupt that is not Holdpoint's is returned to the caller, with the
        graph paused on it. `durability` defaults to "sync": the model's tool call is stored
        before the tool runs (and a turn's input before its first step)."""
        flow = self._thread(_Blocking(graph), input, config, timeout, complete, turn, options)
        return drive(flow, self._blocking().client)

    async def ainvoke(
        self,
        graph: Any,
        input: Any,
        config: RunnableConfig,
        *,
        timeout: float | None = None,
        complete: bool = True,
        turn: str | None = None,
        **options: Any,
    ) -> Any:
        """`invoke` on the event loop (`graph.ainvoke`), with an AsyncHoldpoint."""
        flow = self._thread(_Asyncio(graph), input, config, timeout, complete, turn, options)
        return await adrive(flow, self._asyncio().client)

    def _thread(
        self,
        graph: _Blocking,
        input: Any,
        config: RunnableConfig,
        timeout: float | None,
        complete: bool,
        turn: str | None,
        options: dict[str, Any],
    ) -> Flow[Any]:
        """What `invoke` and `ainvoke` do, once; `graph` runs the graph as the driver can."""
        options.setdefault("durability", "sync")
        if turn is not None:  # every checkpoint of the turn carries its key
            metadata = {**(config.get("metadata") or {}), TURN: turn}
            config = cast(RunnableConfig, {**config, "metadata": metadata})

        def run(value: Any) -> Flow[Any]:
            return (yield from invoke(graph.run, value, config, options))

        snapshot = yield from invoke(graph.state, config)
        if (yield from self._fresh(graph, config, snapshot, turn)):
            values = yield from run(input)
        elif snapshot.interrupts:
            values = yield from run((yield from _decisions(snapshot, timeout)))
        elif snapshot.next:
            values = yield from run(None)  # a predecessor died mid-step
        else:
            values = snapshot.values  # ended: the model is not asked again
        while True:
            snapshot = yield from invoke(graph.state, config)
            if not snapshot.interrupts:
                break
            if not all(_ours(pending) for pending in snapshot.interrupts):
                return values
            values = yield from run((yield from _decisions(snapshot, timeout)))
        if complete and not snapshot.next:
            yield from self._holding(thread_of(config), _nothing, complete=True)
        return values

    @staticmethod
    def _fresh(
        graph: _Blocking, config: RunnableConfig, snapshot: StateSnapshot, turn: str | None
    ) -> Flow[bool]:
        """Whether `input` starts something: a thread never run, or a `turn` (a key the
        caller gives each input of a conversation — the same when a crashed process runs it
        again) whose input the thread has not taken. A turn it has taken is continued where
        it stopped, or, ended, not run again: its model calls are not paid twice. A new
        turn while the one before has not ended would bury that one: refused."""
        if snapshot.created_at is None:
            return True
        if turn is None:
            return False
        thread = {"configurable": config.get("configurable") or {}}
        if (yield from invoke(graph.took, thread, turn)):
            return False
        if snapshot.next or snapshot.interrupts:
            raise ExecutorError(
                f"thread {thread_of(config)!r}: the turn before {turn!r} has not ended; "
                "invoke it again (with its own turn) to finish it first"
            )
        return True

    def wait_for_decision(self, pending: Any, *, timeout: float | None = None) -> Command[Any]:
        """See the module-level `wait_for_decision`."""
        return wait_for_decision(self._blocking(), pending, timeout=timeout)

    async def await_decision(self, pending: Any, *, timeout: float | None = None) -> Command[Any]:
        """See the module-level `await_decision`."""
        return await await_decision(self._asyncio(), pending, timeout=timeout)

    def complete(self, thread: str) -> None:
        """Complete the thread's Holdpoint run (created if no call was ledgered in it)."""
        drive(self._holding(thread, _nothing, complete=True), self._blocking().client)

    async def acomplete(self, thread: str) -> None:
        """`complete`, awaited."""
        await adrive(self._holding(thread, _nothing, complete=True), self._asyncio().client)


class _Blocking:
    """How the thread's driver runs the graph: blocking calls."""

    def __init__(self, graph: Any) -> None:
        self.graph = graph

    def state(self, config: RunnableConfig) -> Any:
        return self.graph.get_state(config)

    def run(self, value: Any, config: RunnableConfig, options: dict[str, Any]) -> Any:
        return self.graph.invoke(value, config, **options)

    def took(self, thread: RunnableConfig, turn: str) -> Any:
        """Whether a checkpoint of the thread carries the turn's key."""
        return next(iter(self.graph.get_state_history(thread, filter={TURN: turn}, limit=1)), None)


class _Asyncio(_Blocking):
    """How the thread's driver runs the graph: on the event loop (the driver awaits)."""

    def state(self, config: RunnableConfig) -> Any:
        return self.graph.aget_state(config)

    def run(self, value: Any, config: RunnableConfig, options: dict[str, Any]) -> Any:
        return self.graph.ainvoke(value, config, **options)

    async def took(self, thread: RunnableConfig, turn: str) -> Any:
        found: AsyncIterator[Any] = self.graph.aget_state_history(
            thread, filter={TURN: turn}, limit=1
        )
        async for checkpoint in found:
            return checkpoint
        return None


def _nothing(run: RunCore[Any]) -> Flow[None]:
    """The body of a run entered only to be left (completed)."""
    yield from ()


def _approved(request: ToolCallRequest, call: ToolCall) -> ToolCallRequest:
    """The request as approved: the params the ledger hands `perform` (a reviewer's edits)."""
    tool_call = request.tool_call
    approved = LangChainToolCall(name=tool_call["name"], args=dict(call.params), id=tool_call["id"])
    return request.override(tool_call=approved)


def wait_for_decision(hp: Holdpoint, pending: Any, *, timeout: float | None = None) -> Command[Any]:
    """Block until each Holdpoint approval the graph waits on is decided; return the
    `Command(resume=...)` that continues it.

    `pending`: what `graph.invoke` returned, `graph.get_state(config)`, or interrupts. The
    approvals are long-polled (no busy loop); `timeout` raises ApprovalTimeout (nothing is
    lost: call again). The resume value only informs the graph — the ledgered tool reads the
    decision from Holdpoint itself.
    """
    return drive(_decisions(pending, timeout), hp.client)


async def await_decision(
    hp: AsyncHoldpoint, pending: Any, *, timeout: float | None = None
) -> Command[Any]:
    """`wait_for_decision` on the event loop, with an AsyncHoldpoint (`pending`: what
    `graph.ainvoke` returned, `await graph.aget_state(config)`, or interrupts)."""
    return await adrive(_decisions(pending, timeout), hp.client)


def _decisions(pending: Any, timeout: float | None) -> Flow[Command[Any]]:
    deadline = None if timeout is None else time.monotonic() + timeout
    resume: dict[str, Any] = {}
    for found in _interrupts(pending):
        if not _ours(found):
            continue
        decided = []
        for call in found.value.get("calls") or [found.value]:  # every held call it lists
            approval = yield from ask(calls.get_approval(call["approval_id"]))
            while approval.pending:
                wait = 30.0
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ApprovalTimeout(f"no decision yet on approval {approval.id}")
                    wait = max(1.0, min(wait, left))
                approval = yield from ask(calls.get_approval(approval.id, wait))
            decided.append(decision(approval))
        fault("after_decision")  # decided; the graph has not resumed with it yet
        resume[found.id] = {**decided[0], "decisions": decided}
    return Command(resume=resume)


__all__ = [
    "HoldpointGraph",
    "KIND",
    "await_decision",
    "current_call",
    "answered",
    "decision",
    "request_page",
    "thread_of",
    "wait_for_decision",
]
