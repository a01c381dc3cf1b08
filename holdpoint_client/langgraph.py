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

Only the tools named with `action()` are ledgered; the others run as before. Imported only
by agents that use LangGraph: `import holdpoint_client` never imports it.
"""

from __future__ import annotations

import contextvars
import inspect
import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import UnionType
from typing import Any, TypeVar, Union, cast, get_args, get_origin, get_type_hints

from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.messages import ToolCall as LangChainToolCall
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool
from langgraph.errors import GraphBubbleUp, GraphInterrupt
from langgraph.prebuilt import ToolNode
from langgraph.prebuilt.tool_node import TOOL_CALL_ERROR_TEMPLATE, ToolCallRequest
from langgraph.types import Command, Interrupt, StateSnapshot, interrupt
from pydantic import BaseModel, ValidationError
from pydantic_core import to_jsonable_python

from holdpoint_client import calls
from holdpoint_client.agent import Holdpoint, Proof, RunHandle, proved
from holdpoint_client.calls import API_PREFIX
from holdpoint_client.errors import (
    ActionFailed,
    ActionWithdrawn,
    ApprovalTimeout,
    ExecutorError,
    Rejected,
)
from holdpoint_client.faults import fault
from holdpoint_client.flow import drive
from holdpoint_client.models import Action, Approval
from holdpoint_client.toolcall import ToolCall

KIND = "holdpoint.approval"  # the `type` of the interrupt values this module raises
TURN = "holdpoint_turn"  # the checkpoint metadata key naming the turn of `invoke(turn=...)`
T = TypeVar("T", bound=BaseTool)
Execute = Callable[[ToolCallRequest], ToolMessage | Command[Any]]
_call: contextvars.ContextVar[ToolCall | None] = contextvars.ContextVar(
    "holdpoint_tool_call", default=None
)


def current_call() -> ToolCall:
    """The ledger's view of the tool call being performed: `.params` (the approved ones),
    `.headers()` (Idempotency-Key, Holdpoint-Run, Holdpoint-Fence) for the service.

    A LangChain tool cannot be handed it as an argument: ToolNode strips every injected
    argument the caller supplies (a model could forge one), so it travels in a context
    variable set around the tool's execution."""
    call = _call.get()
    if call is None:
        raise ExecutorError("current_call() outside a Holdpoint-ledgered tool call")
    return call


@dataclass(frozen=True)
class Spec:
    """How one LangChain tool is ledgered (see HoldpointGraph.action)."""

    tool: str
    reason: str | Callable[[dict[str, Any]], str] | None
    lookup: Callable[[ToolCall], Any] | None
    external_id: Proof


# A task LangGraph started for one `Send` (`create_agent` sends each tool call so) has this
# trigger in its metadata (`langgraph_triggers`): its calls are the Send's, not the message's.
SENT = "__pregel_push"
MAX_BATCHES = 256  # batches kept for tool node runs some call of which never finished


@dataclass
class Batch:
    """The ledgered calls one run of a tool node settles together — a model message's, in
    one LangGraph task, each on a thread of its own — and what asking their hold points
    came to: an interrupt to pause with, or the calls whose hold points the caller saw (an
    answered interrupt listed them: a still pending decision is waited for)."""

    key: tuple[str, int]  # (its task's checkpoint_ns, id(state)): where `_batches` has it
    state: Any  # the node's input: kept, so that its id names this run while it lasts
    left: int  # calls that have not finished with it yet
    members: tuple[LangChainToolCall, ...] = ()
    lock: threading.Lock = field(default_factory=threading.Lock)
    asked: bool = False
    interrupted: tuple[Interrupt, ...] = ()
    surfaced: set[str] = field(default_factory=set)  # tool_call ids


class ToolErrored(Exception):
    """The tool node turned an exception of the tool into an error message: whether the
    effect happened cannot be told from it, so the server's reconcile decides."""


class HoldpointGraph:
    """Holdpoint for one LangGraph agent: which tools are ledgered, and as what.

    `graph` names the agent in Holdpoint (the run's graph); `goal` is the run's goal when the
    first ledgered call of a thread creates it. `approval_timeout` bounds the wait for a
    reviewer after a resume (None: as long as it takes; the lease is renewed meanwhile).
    """

    def __init__(
        self,
        hp: Holdpoint,
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
        (the service's answer, or None). `external_id` is the answer's key holding the proof
        (or a function of the answer). The tool itself is returned unchanged.
        """

        def register(fn: T) -> T:
            self.specs[fn.name] = Spec(tool, reason, lookup, external_id)
            return fn

        return register

    def tool_node(self, tools: Sequence[BaseTool | Callable[..., Any]], **options: Any) -> ToolNode:
        """A `ToolNode` running `tools`, the ledgered ones through Holdpoint.

        `handle_tool_errors` applies to the tools' own errors only. What the ledger raises
        for a ledgered call (OutcomeUnknown, LeaseLost, Holdpoint unreachable, ...) stops
        the graph whatever it says: the ToolNode would tell it to the model as an error,
        and the model would ask again under a new call id — a new action, and the effect
        twice."""
        flag = options.get("handle_tool_errors", _TOOL_NODE_DEFAULT)
        options["handle_tool_errors"] = _sparing_the_ledger(flag)
        return ToolNode(tools, wrap_tool_call=self, **options)

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

        return HoldpointMiddleware()

    # --- one tool call ---------------------------------------------------------------------

    def __call__(self, request: ToolCallRequest, execute: Execute) -> ToolMessage | Command[Any]:
        """The `wrap_tool_call` of a ToolNode: a ledgered tool's call becomes an action."""
        tool_call = request.tool_call
        spec = self.specs.get(tool_call["name"])
        if spec is None or not _fits(request.tool, tool_call):
            return execute(request)  # not ledgered, or the node reports the bad arguments
        config = request.runtime.config if request.runtime is not None else None
        try:
            return self._ledgered(request, execute, spec, thread_of(config), tool_call)
        except GraphBubbleUp:
            raise  # an interrupt: the graph pauses at the hold point
        except Exception as exc:
            setattr(exc, _STOP, True)  # not the tool's error: see `tool_node`
            raise

    def _ledgered(
        self,
        request: ToolCallRequest,
        execute: Execute,
        spec: Spec,
        thread: str,
        tool_call: LangChainToolCall,
    ) -> ToolMessage:
        """One ledgered tool call, settled by the ledger or paused at its hold point."""
        params = dict(tool_call["args"])
        paired = _with_artifact(request)

        def perform(call: ToolCall) -> Any:
            token = _call.set(call)
            try:
                approved = LangChainToolCall(
                    name=tool_call["name"], args=dict(call.params), id=tool_call["id"]
                )
                return _answer(execute(request.override(tool_call=approved)), paired)
            finally:
                _call.reset(token)

        label = f"lc:{tool_call['id']}"

        def act(approval_timeout: float | None) -> Any:
            with (
                self._lock(thread),
                self.hp.run(thread, graph=self.graph, goal=self.goal, complete=False) as run,
            ):
                _not_of_an_older_goal(run, label)
                return run.act(
                    spec.tool,
                    params,
                    reason=_reason(spec, request.state, request.tool, params),
                    perform=perform,
                    lookup=spec.lookup,
                    label=label,
                    external_id=_in_artifact(spec.external_id) if paired else spec.external_id,
                    approval_timeout=approval_timeout,
                )

        batch = self._batch(request, tool_call)
        try:
            # Every hold point of the node's calls, asked together before any is settled:
            # raises GraphInterrupt (the graph pauses, the checkpointer keeps it) unless
            # this is a resume; then each decision is read from Holdpoint, not from it.
            self._ask(batch, request, thread)
            try:
                result = act(0)  # settled, or held: never blocks on a reviewer here
            except ApprovalTimeout as held:
                if str(tool_call["id"]) not in batch.surfaced:  # held anew, at its dispatch
                    with batch.lock:
                        interrupt(self._pending(held.action, thread, str(tool_call["id"])))
                result = act(self.approval_timeout)
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

    def _lock(self, thread: str) -> threading.Lock:
        """One call at a time per thread in this process: ToolNode runs a message's tool
        calls in parallel threads, and they share one lease owner."""
        with self._guard:
            return self._locks.setdefault(thread, threading.Lock())

    # --- the hold points of the calls one tool node runs together ----------------------------

    def _batch(self, request: ToolCallRequest, tool_call: LangChainToolCall) -> Batch:
        """The batch of this run of the tool node, shared by the threads of its calls: the
        node's input (`request.state`, the same object for each call of one run, a new one
        for the next run) in its LangGraph task (`checkpoint_ns`)."""
        members = self._members(request, tool_call)
        config = request.runtime.config if request.runtime is not None else {}
        key = (str((config.get("configurable") or {}).get("checkpoint_ns", "")), id(request.state))
        with self._guard:
            found = self._batches.get(key)
            if found is None or found.state is not request.state:
                found = self._batches[key] = Batch(key, request.state, len(members))
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

    def _ask(self, batch: Batch, request: ToolCallRequest, thread: str) -> None:
        """Ask the hold points of the batch's calls, once per run of the node, before any
        is settled — in one interrupt listing every held call (LangChain's
        HumanInTheLoopMiddleware asks a message's calls so). LangGraph shows one interrupt
        of a task at a time and hands the task's answers out in the order its interrupts
        are asked: asked from each call's thread, the others would surface only after the
        first was answered, and its answer could go to another call's thread. So one thread
        asks for all; every thread of the batch pauses with that interrupt."""
        with batch.lock:
            if not batch.asked:
                pending = self._held(batch, request, thread)
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
        if batch.interrupted:
            raise GraphInterrupt(batch.interrupted)

    def _held(self, batch: Batch, request: ToolCallRequest, thread: str) -> list[dict[str, Any]]:
        """The interrupt values of the batch's calls held for a reviewer: each call's action
        found or prepared (nothing is sent), in the model's order. A call of an older goal
        revision is left to its own thread, which tells the model."""
        tools = {t.name: t for t in getattr(request.runtime, "tools", None) or ()}
        held: list[tuple[Action, str]] = []
        with (
            self._lock(thread),
            self.hp.run(thread, graph=self.graph, goal=self.goal, complete=False) as run,
        ):
            if run.finished:
                return []  # every call is answered from the record
            for call in batch.members:
                label = f"lc:{call['id']}"
                try:
                    _not_of_an_older_goal(run, label)
                except OlderGoal:
                    continue
                spec, params = self.specs[call["name"]], dict(call["args"])
                why = _reason(spec, request.state, tools.get(call["name"]), params)
                flow = run.ex.find_or_prepare(spec.tool, params, label, why)
                action = drive(flow, run.client)
                if action.status == "awaiting_approval":
                    held.append((action, str(call["id"])))
        return [self._pending(action, thread, call_id) for action, call_id in held]

    def _pending(self, action: Action, thread: str, tool_call_id: str) -> dict[str, Any]:
        """The interrupt's value: what a person or a resumer needs to find the decision."""
        if action.approval is None:  # raised with the hold, so read again it is there
            action = self.hp.client.get_action(action.action_id)
        approval = self.hp.client.get_approval(str(action.approval))
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
        options.setdefault("durability", "sync")
        if turn is not None:  # every checkpoint of the turn carries its key
            metadata = {**(config.get("metadata") or {}), TURN: turn}
            config = cast(RunnableConfig, {**config, "metadata": metadata})
        snapshot = graph.get_state(config)
        if self._fresh(graph, config, snapshot, turn):
            values = graph.invoke(input, config, **options)
        elif snapshot.interrupts:
            values = graph.invoke(
                self.wait_for_decision(snapshot, timeout=timeout), config, **options
            )
        elif snapshot.next:
            values = graph.invoke(None, config, **options)  # a predecessor died mid-step
        else:
            values = snapshot.values  # ended: the model is not asked again
        while True:
            snapshot = graph.get_state(config)
            if not snapshot.interrupts:
                break
            if not all(_ours(pending) for pending in snapshot.interrupts):
                return values
            values = graph.invoke(
                self.wait_for_decision(snapshot, timeout=timeout), config, **options
            )
        if complete and not snapshot.next:
            self.complete(thread_of(config))
        return values

    @staticmethod
    def _fresh(
        graph: Any, config: RunnableConfig, snapshot: StateSnapshot, turn: str | None
    ) -> bool:
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
        if next(iter(graph.get_state_history(thread, filter={TURN: turn}, limit=1)), None):
            return False
        if snapshot.next or snapshot.interrupts:
            raise ExecutorError(
                f"thread {thread_of(config)!r}: the turn before {turn!r} has not ended; "
                "invoke it again (with its own turn) to finish it first"
            )
        return True

    def wait_for_decision(self, pending: Any, *, timeout: float | None = None) -> Command[Any]:
        """See the module-level `wait_for_decision`."""
        return wait_for_decision(self.hp, pending, timeout=timeout)

    def complete(self, thread: str) -> None:
        """Complete the thread's Holdpoint run (created if no call was ledgered in it)."""
        with self.hp.run(thread, graph=self.graph, goal=self.goal):
            pass


def wait_for_decision(hp: Holdpoint, pending: Any, *, timeout: float | None = None) -> Command[Any]:
    """Block until each Holdpoint approval the graph waits on is decided; return the
    `Command(resume=...)` that continues it.

    `pending`: what `graph.invoke` returned, `graph.get_state(config)`, or interrupts. The
    approvals are long-polled (no busy loop); `timeout` raises ApprovalTimeout (nothing is
    lost: call again). The resume value only informs the graph — the ledgered tool reads the
    decision from Holdpoint itself.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    resume: dict[str, Any] = {}
    for found in _interrupts(pending):
        if not _ours(found):
            continue
        decided = []
        for call in found.value.get("calls") or [found.value]:  # every held call it lists
            approval = hp.client.get_approval(call["approval_id"])
            while approval.pending:
                wait = 30.0
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ApprovalTimeout(f"no decision yet on approval {approval.id}")
                    wait = max(1.0, min(wait, left))
                approval = hp.client.get_approval(approval.id, wait=wait)
            decided.append(decision(approval))
        fault("after_decision")  # decided; the graph has not resumed with it yet
        resume[found.id] = {**decided[0], "decisions": decided}
    return Command(resume=resume)


def answered(resume: Any) -> set[str]:
    """The approvals a resume value says it answers (`wait_for_decision`'s name them);
    empty for a value that names none — then it answers whatever its interrupt listed.
    Only which hold points the caller was shown is read from it, never a decision."""
    if not isinstance(resume, Mapping):
        return set()
    listed = resume.get("decisions")
    decided = listed if isinstance(listed, list) else [resume]
    return {
        str(d["approval_id"]) for d in decided if isinstance(d, Mapping) and d.get("approval_id")
    }


def decision(approval: Approval) -> dict[str, Any]:
    """The resume value for one approval: its status and the reviewer's reason."""
    return {
        "type": KIND,
        "approval_id": approval.id,
        "status": approval.status,
        "reason": approval.decision_reason,
    }


def request_page(hp: Holdpoint, approval_id: str) -> str:
    """The approval's page in Holdpoint's web UI, where a reviewer decides."""
    root = hp.client.base_url.rstrip("/").removesuffix(API_PREFIX.rstrip("/"))
    return f"{root}/approvals/{approval_id}/"


def thread_of(config: RunnableConfig | None) -> str:
    """The LangGraph thread id, which names the Holdpoint run."""
    thread = ((config or {}).get("configurable") or {}).get("thread_id")
    if not thread:
        raise ExecutorError(
            "a Holdpoint-ledgered tool needs a checkpointer and "
            "config={'configurable': {'thread_id': ...}}"
        )
    return str(thread)


def _interrupts(pending: Any) -> Iterable[Interrupt]:
    if isinstance(pending, StateSnapshot):
        return pending.interrupts
    if isinstance(pending, Mapping):
        return pending.get("__interrupt__") or ()
    if isinstance(pending, Interrupt):
        return (pending,)
    return tuple(pending)


def _ours(found: Interrupt) -> bool:
    return isinstance(found.value, Mapping) and found.value.get("type") == KIND


# Statuses of an action that certainly never reached its service (DESIGN.md: `sent` is
# written before the request leaves): a held call withdrawn by a goal revision ends here.
NEVER_SENT = frozenset({"prepared", "awaiting_approval", "approved", "cancelled"})


class OlderGoal(ActionWithdrawn):
    """The model asked for the call under a goal revision since revised."""

    @property
    def may_have_run(self) -> bool:
        """Whether the old goal's action may have reached the service: the model is told
        the call was not run *again* — else that it was not run (it never left: a call held
        at a hold point when the goal was revised), lest it report an effect nobody made."""
        return self.action is None or self.action.status not in NEVER_SENT


def _not_of_an_older_goal(run: RunHandle, label: str) -> None:
    """Refuse a call the model asked for before the goal was last revised: its action (under
    the older revision's key) was withdrawn, or sent for the old goal — preparing it again
    under the new key would be a second effect the new goal never asked for. Runs never
    revised (goal_rev 1) ask nothing; a revised one asks once per older revision."""
    for goal_rev in range(run.ex.goal_rev - 1, 0, -1):
        key = run.ex.key_for(label, goal_rev)
        page = run.client.send(calls.actions_page(idempotency_key=key))
        if page.results:
            action = page.results[0]
            fate = (
                f"its action was withdrawn with the old goal ({action.status}): nothing was sent"
                if action.status in NEVER_SENT
                else f"its action stays the old goal's ({action.status})"
            )
            raise OlderGoal(
                f"the goal was revised since the model asked for it (under goal revision "
                f"{goal_rev}, now {run.ex.goal_rev}); {fate}",
                action=action,
            )


# The attribute marking an exception the ledger raised for a ledgered call, and what a
# ToolNode does with a tool's error when not told otherwise.
_STOP = "_holdpoint_stops_the_graph"
_TOOL_NODE_DEFAULT = inspect.signature(ToolNode).parameters["handle_tool_errors"].default
Handling = bool | str | Callable[..., str] | type[Exception] | tuple[type[Exception], ...]


def _sparing_the_ledger(flag: Handling) -> Handling:
    """`handle_tool_errors` as asked, for the tools' own errors; an exception the ledger
    raised (marked by `HoldpointGraph.__call__`) is raised on, as LangGraph's default
    handler raises what it does not handle. False handles nothing: nothing to spare."""
    if not flag:
        return flag
    handled = _handled_types(flag)

    def handle(error: Exception) -> str:
        if getattr(error, _STOP, False) or not isinstance(error, handled):
            raise error
        if isinstance(flag, str):
            return flag
        if callable(flag) and not isinstance(flag, type):
            return str(flag(error))
        return TOOL_CALL_ERROR_TEMPLATE.format(error=repr(error))

    return handle


def _handled_types(flag: Handling) -> tuple[type[Exception], ...]:
    """The exceptions a `handle_tool_errors` value handles (ToolNode's reading: a handler
    function's by the annotation of its first parameter)."""
    if isinstance(flag, type):
        return (flag,)
    if isinstance(flag, tuple):
        return flag
    if not callable(flag):
        return (Exception,)
    first = next(iter(inspect.signature(flag).parameters.values()), None)
    hint = get_type_hints(flag).get(first.name) if first is not None else None
    kinds = get_args(hint) if get_origin(hint) in (Union, UnionType) else (hint,)
    if all(isinstance(k, type) and issubclass(k, Exception) for k in kinds):
        return tuple(kinds)
    return (Exception,)


def _fits(tool: BaseTool | None, call: LangChainToolCall) -> bool:
    """Whether the model's arguments fit the tool: a call that cannot run is reported by
    the tool node as usual and never shown to a reviewer."""
    schema = tool.tool_call_schema if tool is not None else None
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        try:
            schema.model_validate(call["args"])
        except ValidationError:
            return False
    return True


def _messages(state: Any) -> list[Any]:
    """The messages of a tool node's input state (a dict, a list, or an object with
    `messages`), as ToolNode reads them."""
    if isinstance(state, Mapping):
        found = state.get("messages", ())
    elif isinstance(state, list):
        found = state
    else:
        found = getattr(state, "messages", ())
    return list(found or ())


def _latest_ai_message(state: Any) -> AIMessage | None:
    """The model message whose calls the tool node runs: the latest, as ToolNode takes it."""
    return next((m for m in reversed(_messages(state)) if isinstance(m, AIMessage)), None)


def _reason(spec: Spec, state: Any, tool: BaseTool | None, params: dict[str, Any]) -> str:
    if callable(spec.reason):
        return spec.reason(params)
    if spec.reason:
        return spec.reason
    message = _latest_ai_message(state)
    if message is not None and isinstance(message.content, str) and message.content.strip():
        return message.content.strip()
    description = tool.description if tool is not None else ""
    return (description or spec.tool).strip().splitlines()[0]


def _with_artifact(request: ToolCallRequest) -> bool:
    """Whether the tool returns `(content, artifact)` (`response_format=
    "content_and_artifact"`): the ToolMessage's content is what the model reads, the
    artifact the raw answer kept beside it for the program — never shown to the model."""
    return getattr(request.tool, "response_format", "content") == "content_and_artifact"


def _answer(message: ToolMessage | Command[Any], paired: bool = False) -> Any:
    """What the ledger records of the tool node's message: the service's answer (the
    content, as JSON where it is JSON) — or, for a tool with an artifact (`paired`), both
    halves, `{"content", "artifact"}`: what the model was told and what the service
    answered, for a reviewer or auditor, and for the message rebuilt from the record after
    a restart. An artifact holding what JSON has no word for (a datetime, a model object)
    is recorded as JSON: refused, the outcome of a call that happened could not be
    recorded at all."""
    if not isinstance(message, ToolMessage):
        raise ToolErrored("a ledgered tool must return data, not a Command")
    if message.status == "error":
        raise ToolErrored(str(message.content))
    if paired:
        artifact = to_jsonable_python(message.artifact, fallback=str)
        return {"content": message.content, "artifact": artifact}
    content = message.content
    if isinstance(content, str):
        try:
            return json.loads(content)
        except ValueError:
            return content
    return content


def _in_artifact(proof: Proof) -> Proof:
    """The proof of a tool with an artifact is found in the artifact (the service's answer),
    not in the content the model reads."""

    def find(answer: Any) -> str | None:
        found, _ = proved(answer.get("artifact") if isinstance(answer, Mapping) else None, proof)
        return found or None

    return find


def _message(
    request: ToolCallRequest, content: Any, status: str = "success", artifact: Any = None
) -> ToolMessage:
    call = request.tool_call
    return ToolMessage(
        content=content,
        artifact=artifact,
        name=call["name"],
        tool_call_id=call["id"],
        status=status,
    )


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


__all__ = [
    "HoldpointGraph",
    "KIND",
    "current_call",
    "answered",
    "decision",
    "request_page",
    "thread_of",
    "wait_for_decision",
]
