"""`Holdpoint`: the few lines an external agent author writes, with every guarantee kept.

    hp = Holdpoint.from_env()
    with hp.run("thread-42", graph="api-review", goal=goal) as run:
        task = run.act("agent.tasks.create", params, reason="…", perform=create_task)

What the handle does so the author need not:

- The run is found again by the author's stable `thread_id` (`GET runs/?thread_id=`), or
  created external with an Idempotency-Key derived from the thread, so two processes
  racing to start the same thread get one run.
- The lease is taken (an `Executor` underneath: heartbeats; a dead predecessor's lease is
  waited out) and released on exit; a clean exit completes the run.
- Each `act` has a label that is the same in every process that runs the same program: the
  explicit `label`, or the count of `act` calls so far. A restarted agent therefore meets
  the action its predecessor prepared — waiting for its reviewer, sent, or confirmed — and
  continues it instead of acting again. A completed run answers every `act` and `record`
  from what it recorded (a crash after the last action and before completion redoes
  nothing).
- `record`/`model` store a paid or non-deterministic call's result in the run's checkpoint
  (under `_holdpoint`, fenced, compare-and-swap) before returning it; after a crash the
  stored result is returned and the function is not called again.

The logic is written once as flows (holdpoint_client.flow); `Holdpoint` drives them with
blocking calls and `AsyncHoldpoint` on the event loop.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import inspect
import json
import os
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Generic, ParamSpec, TypedDict, TypeVar, Unpack, cast

from holdpoint_client import calls
from holdpoint_client.aio import AsyncClient, AsyncExecutor
from holdpoint_client.calls import dumps
from holdpoint_client.client import Client
from holdpoint_client.errors import (
    AlreadyCompleted,
    ExecutorError,
    HoldpointAPIError,
    HoldpointError,
    VersionConflict,
)
from holdpoint_client.executor import Executor, ExecutorCore
from holdpoint_client.faults import fault
from holdpoint_client.flow import Flow, adrive, ask, call_agent, drive, refuse_async
from holdpoint_client.models import Action, Run
from holdpoint_client.toolcall import ToolCall

P = ParamSpec("P")
R = TypeVar("R")
C = TypeVar("C", Client, AsyncClient)
H = TypeVar("H")
RESERVED = "_holdpoint"  # the checkpoint state's key for recorded calls
STEP = "ext:agent"  # the next_step an unfinished external run's checkpoints name
# How the proof of an effect is found in what `perform` returned: a key of a JSON object,
# or a function of the answer.
Proof = str | Callable[[Any], Any]
_current: contextvars.ContextVar[RunCore[Any] | None] = contextvars.ContextVar(
    "holdpoint_run", default=None
)


class NotRecorded(ExecutorError):
    """The run is finished, and what was asked of it was never recorded in it."""


def external_run(thread_id: str) -> Flow[Run | None]:
    """The thread's newest external run (API.md, "External executors"), or None.

    A thread id may also name hosted runs, which Holdpoint's workers execute: they are never
    an agent's to lease, resume or wait on, so everything that finds "the agent's run of a
    thread" (`hp.run`, `wait_for_decision`) finds it here. A run without the `external`
    field (a server older than it) counts as external."""
    cursor: str | None = None
    while True:
        page = yield from ask(calls.runs_page(thread_id=thread_id, cursor=cursor))
        for run in page.results:  # newest first
            if run.raw.get("external", True):
                return run
        if not page.next_cursor:
            return None
        cursor = page.next_cursor


def thread_key(thread_id: str) -> str:
    """The Idempotency-Key of a thread's run creation: the same in every process."""
    return "hp-run-" + hashlib.sha256(thread_id.encode()).hexdigest()[:48]


def proved(answer: Any, proof: Proof) -> tuple[str, Any]:
    """(external_id, result) of a tool's answer, as the ledger records it."""
    if callable(proof):
        found = proof(answer)
    elif isinstance(answer, Mapping):
        found = answer.get(proof)
    else:
        found = None
    return ("" if found is None else str(found)), answer


def _proving(
    fn: Callable[[ToolCall], Any] | None, proof: Proof
) -> Callable[[ToolCall], Any] | None:
    """`fn` (the author's perform or lookup, returning the service's answer) as the
    executor's, returning (external_id, result); an async one stays async."""
    if fn is None:
        return None
    if inspect.iscoroutinefunction(fn):  # stays one: the asyncio driver awaits it on its loop

        async def acall(tool_call: ToolCall) -> tuple[str, Any] | None:
            return await _later(fn(tool_call), proof)

        return acall

    def call(tool_call: ToolCall) -> Any:
        answer = fn(tool_call)
        if inspect.isawaitable(answer):
            return _later(answer, proof)
        return None if answer is None else proved(answer, proof)

    return call


async def _later(answer: Awaitable[Any], proof: Proof) -> tuple[str, Any] | None:
    value = await answer
    return None if value is None else proved(value, proof)


class RunActOptions(TypedDict, total=False):
    """`run.act`'s optional keywords (see RunHandle.act)."""

    perform: Callable[[ToolCall], Any] | None
    lookup: Callable[[ToolCall], Any] | None
    label: str | None
    target: str
    external_id: Proof
    approval_timeout: float | None


class RunCore(Generic[C]):
    """One agent's hold on one run: what `RunHandle` and `AsyncRunHandle` share."""

    def __init__(
        self,
        client: C,
        thread_id: str,
        *,
        owner: str,
        ttl: int,
        lease_timeout: float,
        graph: str,
        goal: Any,
        graph_version: str | None,
        complete: bool,
        approval_timeout: float | None,
        resolution_timeout: float | None,
    ) -> None:
        self.client: C = client
        self.lease = (owner, ttl, lease_timeout)
        self.thread_id = thread_id
        self.graph = graph
        self.goal_asked = goal
        self.graph_version = graph_version
        self.complete = complete
        self.approval_timeout = approval_timeout
        self.resolution_timeout = resolution_timeout
        self.info: Run | None = None
        self.state: dict[str, Any] = {}
        self.finished = False  # completed before this process came: answers from the record
        self.last_action: Action | None = None
        self._acts = 0
        self._token: contextvars.Token[RunCore[Any] | None] | None = None
        self._ex: ExecutorCore[C] | None = None

    def _executor(self, run_id: str) -> ExecutorCore[C]:
        raise NotImplementedError

    @property
    def ex(self) -> ExecutorCore[C]:
        if self._ex is None:
            raise ExecutorError("the run is not open: use it as a context manager")
        return self._ex

    @property
    def run_id(self) -> str:
        return self.ex.run_id

    @property
    def goal(self) -> Any:
        """The run's goal as Holdpoint holds it (the one it was created with, or revised)."""
        return self.info.goal if self.info is not None else self.goal_asked

    # --- flows -----------------------------------------------------------------------------

    def _find_or_create(self) -> Flow[Run]:
        found = yield from external_run(self.thread_id)
        if found is not None:
            return found
        call = calls.create_run(
            self.graph,
            self.goal_asked,
            thread_id=self.thread_id,
            graph_version=self.graph_version,
            idempotency_key=thread_key(self.thread_id),
            external=True,
        )
        return (yield from ask(call))

    def _open(self) -> Flow[None]:
        run = yield from self._find_or_create()
        self._ex = self._executor(run.run_id)
        self.info = run
        if run.status == "completed":
            self._as_finished(run)
        else:
            try:
                yield from self.ex._acquire_flow()
            except AlreadyCompleted:  # completed meanwhile, by a predecessor
                self._as_finished((yield from ask(calls.get_run(run.run_id))))
            else:
                self.info = self.ex._run
        try:
            self.state = yield from self._load()
        except Exception:
            # `with` never reaches __exit__ when __enter__ raises: let go of the lease here,
            # or its heartbeat renews it for nobody and every later try meets LeaseHeld.
            if not self.finished:
                yield from self.ex._close_flow()
            raise
        self._token = _current.set(self)

    def _as_finished(self, run: Run) -> None:
        self.finished = True
        self.ex._run = run
        self.ex.rev = run.checkpoint_rev

    def _load(self) -> Flow[dict[str, Any]]:
        if not self.finished:
            return (yield from self.ex._load_flow())
        if not self.ex.rev:
            return {}
        checkpoint = yield from ask(calls.get_checkpoint(self.run_id, self.ex.rev, inline=True))
        return dict(checkpoint.state) if isinstance(checkpoint.state, Mapping) else {}

    def _close(self, failed: bool) -> Flow[None]:
        """A clean exit completes the run (unless `complete=False`); any exit lets go."""
        if self._token is not None:
            _current.reset(self._token)
            self._token = None
        if self._ex is None or self.finished:
            return
        try:
            if not failed and self.complete and not self.ex.lost:
                yield from self.ex._checkpoint_flow(self.state, "", "completed")
        finally:
            yield from self.ex._close_flow()

    def _act(
        self,
        tool: str,
        params: Mapping[str, Any],
        *,
        reason: str,
        perform: Callable[[ToolCall], Any] | None = None,
        lookup: Callable[[ToolCall], Any] | None = None,
        label: str | None = None,
        target: str = "",
        external_id: Proof = "id",
        approval_timeout: float | None = None,
    ) -> Flow[Any]:
        self._acts += 1
        call = label or f"act-{self._acts}"
        if self.finished:
            action = yield from self._recorded_action(call)
        else:
            if perform is None:
                yield from self._needs_no_perform(tool)
            action = yield from self.ex._act_flow(
                tool,
                params,
                call=call,
                perform=_proving(perform, external_id),
                reason=reason,
                target=target,
                lookup=_proving(lookup, external_id),
                approval_timeout=self.approval_timeout
                if approval_timeout is None
                else approval_timeout,
                resolution_timeout=self.resolution_timeout,
            )
        self.last_action = action
        return action.result

    def _needs_no_perform(self, tool: str) -> Flow[None]:
        """Refuse, before anything is prepared, a client tool asked for without `perform`:
        dispatched, it would be `sent` with nobody to send it. The tool's definition says
        (`GET tools/{name}/`, API.md "Tools as data"); a server without it decides itself."""
        try:
            definition = yield from ask(calls.get(calls.at("tools", tool), dict))
        except HoldpointAPIError:
            return
        if definition.get("executor") == "client":
            raise ExecutorError(
                f"{tool} is performed by the agent (executor client): pass perform="
            )

    def _recorded_action(self, call: str) -> Flow[Action]:
        """A finished run's action for this label, settled as the ledger says."""
        key = self.ex.key_for(call)
        page = yield from ask(calls.actions_page(idempotency_key=key))
        action = page.results[0] if page.results else None
        if action is None:
            raise NotRecorded(f"run {self.run_id} is finished; {call!r} was never prepared in it")
        if action.status in ("confirmed", "compensated"):
            return action
        if action.status == "cancelled":
            raise (yield from self.ex._cancelled(action))
        raise NotRecorded(f"run {self.run_id} is finished; {call!r} is {action.status}")

    def _record(self, kind: str, key: str, fn: Callable[[], Any]) -> Flow[Any]:
        slot = f"{kind}:{key}"
        records = self.state.get(RESERVED) or {}
        if slot in records:
            return records[slot]
        if self.finished:
            raise NotRecorded(f"run {self.run_id} is finished; {slot!r} was never recorded")
        value = yield from call_agent(fn)
        value = json.loads(dumps(value))  # what storage gives back, the first time too
        for _ in range(3):
            state = {**self.state, RESERVED: {**(self.state.get(RESERVED) or {}), slot: value}}
            try:
                yield from self.ex._checkpoint_flow(state, STEP)
            except VersionConflict:  # someone wrote meanwhile (the server, a reviewer)
                self.state = yield from self._load()
                continue
            self.state = state
            fault("after_record")
            return value
        raise ExecutorError(f"could not store {slot!r}: the checkpoint kept moving")


def _owner() -> str:
    return f"holdpoint-agent@{socket.gethostname()}:{os.getpid()}"


class RunHandle(RunCore[Client]):
    """`with hp.run(...) as run:` — see the module docstring."""

    def _executor(self, run_id: str) -> Executor:
        owner, ttl, lease_timeout = self.lease
        return Executor(self.client, run_id, owner, ttl, lease_timeout=lease_timeout)

    def __enter__(self) -> RunHandle:
        drive(self._open(), self.client)
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        drive(self._close(exc is not None), self.client)

    def act(
        self,
        tool: str,
        params: Mapping[str, Any],
        *,
        reason: str,
        **options: Unpack[RunActOptions],
    ) -> Any:
        """One ledgered side effect, exactly once; returns its recorded result.

        `perform(call)` does the effect of a tool the agent performs (executor `client`)
        with `call.params` — the approved ones, possibly edited by the reviewer — and the
        `call.headers()` (its Idempotency-Key); it returns the service's answer, whose
        `external_id` field (default "id"; or a function of the answer) is the proof. Raise
        ToolRefused when the service certainly did not apply it. `lookup(call)` finds the
        effect by key (the answer, or None) for a tool the server reconciles by lookup. A
        tool Holdpoint sends itself (executor `http`) needs neither. `label` names the call
        instead of its place among this run's `act` calls. Raises Rejected(reason),
        ApprovalTimeout (after `approval_timeout` s; everything stays durable: run again to
        go on waiting), ActionFailed, ActionWithdrawn, OutcomeUnknown, LeaseLost.
        """
        refuse_async(options.get("perform"), options.get("lookup"))
        return drive(self._act(tool, params, reason=reason, **options), self.client)

    def record(self, key: str, fn: Callable[[], R]) -> R:
        """`fn()` once per run: its (JSON) result is stored before it is returned, and
        returned from storage ever after — a restarted agent does not pay for it again."""
        refuse_async(fn)
        return cast(R, drive(self._record("record", key, fn), self.client))

    def model(self, key: str, fn: Callable[[], R]) -> R:
        """`record` for a model call, stored as `model:<key>` (apart from other records, as
        hosted graphs keep them): the prompt's answer is reused, never asked again."""
        refuse_async(fn)
        return cast(R, drive(self._record("model", key, fn), self.client))


class AsyncRunHandle(RunCore[AsyncClient]):
    """`async with hp.run(...) as run:` — RunHandle on the event loop."""

    def _executor(self, run_id: str) -> AsyncExecutor:
        owner, ttl, lease_timeout = self.lease
        return AsyncExecutor(self.client, run_id, owner, ttl, lease_timeout=lease_timeout)

    async def __aenter__(self) -> AsyncRunHandle:
        await adrive(self._open(), self.client)
        return self

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        await adrive(self._close(exc is not None), self.client)

    async def act(
        self,
        tool: str,
        params: Mapping[str, Any],
        *,
        reason: str,
        **options: Unpack[RunActOptions],
    ) -> Any:
        """RunHandle.act, awaited; `perform` and `lookup` may be `async def`."""
        return await adrive(self._act(tool, params, reason=reason, **options), self.client)

    async def record(self, key: str, fn: Callable[[], Any]) -> Any:
        """RunHandle.record, awaited; `fn` may be an `async def`."""
        return await adrive(self._record("record", key, fn), self.client)

    async def model(self, key: str, fn: Callable[[], Any]) -> Any:
        """RunHandle.model, awaited; `fn` may be an `async def`."""
        return await adrive(self._record("model", key, fn), self.client)


def current_run() -> RunCore[Any]:
    """The run of the innermost `with hp.run(...)` in this context (thread, task)."""
    run = _current.get()
    if run is None:
        raise ExecutorError("a Holdpoint action is called outside `with hp.run(...)`")
    return run


class _Actions:
    """`@hp.action(tool)`, the same for the blocking and the asyncio entry point."""

    def action(
        self,
        tool: str,
        *,
        reason: str | Callable[..., str] | None = None,
        lookup: Callable[[ToolCall], Any] | None = None,
        external_id: Proof = "id",
        label: str | None = None,
        target: str = "",
    ) -> Callable[[Callable[P, R]], Callable[P, R]]:
        """Make `fn` the `perform` of the client tool `tool`.

        Called inside `with hp.run(...)`, `fn(title=..., body=...)` goes through `run.act`:
        the arguments are the params (`params_of`: defaults included); `fn` itself runs
        with the *approved* params as keyword arguments (a reviewer may have edited them),
        plus `call=` (the ToolCall: its `headers()` carry the Idempotency-Key) if it
        declares a parameter `call`. What `fn`
        returns is recorded and returned; after a crash, the recorded result is returned
        and `fn` is not called again. `reason` defaults to the docstring's first line.
        """

        def decorate(fn: Callable[P, R]) -> Callable[P, R]:
            signature = inspect.signature(fn)
            takes_call = "call" in signature.parameters
            why = reason or (inspect.getdoc(fn) or tool).splitlines()[0]

            def perform(call: ToolCall) -> Any:
                extra = {"call": call} if takes_call else {}
                return fn(**call.params, **extra)  # type: ignore[arg-type, call-arg]

            def act(run: RunCore[Any], args: Any, kwargs: Any) -> Flow[Any]:
                bound = params_of(signature, args, kwargs)
                return run._act(
                    tool,
                    bound,
                    reason=why(**bound) if callable(why) else why,
                    perform=perform,
                    lookup=lookup,
                    label=label,
                    target=target,
                    external_id=external_id,
                    approval_timeout=None,
                )

            if inspect.iscoroutinefunction(fn):

                @functools.wraps(fn)
                async def run_async(*args: P.args, **kwargs: P.kwargs) -> Any:
                    run = current_run()
                    if not isinstance(run, AsyncRunHandle):
                        raise ExecutorError(f"async {tool} needs `async with hp.run(...)`")
                    return await adrive(act(run, args, kwargs), run.client)

                return cast(Callable[P, R], run_async)

            @functools.wraps(fn)
            def run_sync(*args: P.args, **kwargs: P.kwargs) -> R:
                run = current_run()
                if not isinstance(run, RunHandle):
                    raise ExecutorError(f"{tool} needs `with hp.run(...)` (not async)")
                refuse_async(lookup)
                return cast(R, drive(act(run, args, kwargs), run.client))

            return run_sync

        return decorate


def params_of(signature: inspect.Signature, args: Any, kwargs: Any) -> dict[str, Any]:
    """The params of a call of an `@hp.action` function: every argument it will run with —
    its defaults too, and each `**keyword` as a param of its own — for the ledger's params
    are what the reviewer approves, what the action hash binds and what `perform` passes
    back to it; a default left out would be sent unapproved (and changed by a deploy). A
    default of None stands for "absent" (a tool's schema may refuse null): left out, the
    function gets it all the same."""
    bound = signature.bind_partial(*args, **kwargs)
    given = set(bound.arguments)
    bound.apply_defaults()
    params: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if name == "call" or (value is None and name not in given):
            continue
        if kind is inspect.Parameter.VAR_KEYWORD:
            params.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise ExecutorError(f"*{name}: an action's params are named; pass keywords")
        else:
            params[name] = value
    return params


class _Entry(_Actions, Generic[C, H]):
    """What Holdpoint and AsyncHoldpoint share: the client and the lease and waiting
    settings, taken out of the keyword arguments (the others go to the client: timeout,
    retries, backoff, ...).

    `owner`: the lease owner's name; `ttl`: lease seconds (renewed every ttl/3);
    `lease_timeout`: how long `run` waits for another holder's lease (a dead predecessor's
    expires `ttl` after its last heartbeat); `approval_timeout`: the default for `act`
    (None: wait as long as it takes); `resolution_timeout`: how long to wait for a person to
    settle an unknown outcome (None: as long as it takes).
    """

    client: C

    def __init__(
        self,
        *,
        owner: str | None = None,
        ttl: int = 30,
        lease_timeout: float = 120.0,
        approval_timeout: float | None = None,
        resolution_timeout: float | None = None,
    ) -> None:
        self.owner = owner or _owner()
        self.ttl = ttl
        self.lease_timeout = lease_timeout
        self.approval_timeout = approval_timeout
        self.resolution_timeout = resolution_timeout

    def _handle(self, thread_id: str, **settings: Any) -> H:
        raise NotImplementedError

    def run(
        self,
        thread_id: str,
        *,
        graph: str,
        goal: Any = None,
        graph_version: str | None = None,
        complete: bool = True,
    ) -> H:
        """The run of `thread_id`, found again or created (external) with `goal`; use it as
        a context manager. `complete=False` leaves the run open on a clean exit."""
        return self._handle(
            thread_id,
            owner=self.owner,
            ttl=self.ttl,
            lease_timeout=self.lease_timeout,
            graph=graph,
            goal={} if goal is None else goal,
            graph_version=graph_version,
            complete=complete,
            approval_timeout=self.approval_timeout,
            resolution_timeout=self.resolution_timeout,
        )


class Holdpoint(_Entry[Client, RunHandle]):
    """The blocking entry point: `hp = Holdpoint(url, token)` or `Holdpoint.from_env()`
    (HOLDPOINT_URL, HOLDPOINT_TOKEN); keyword arguments as described on `_Entry`."""

    def __init__(self, url: str, token: str, **options: Any) -> None:
        super().__init__(**_settings(options))
        self.client = Client(url, token, **options)

    @classmethod
    def from_env(cls, **options: Any) -> Holdpoint:
        return cls(*_env(), **options)

    def _handle(self, thread_id: str, **settings: Any) -> RunHandle:
        return RunHandle(self.client, thread_id, **settings)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Holdpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncHoldpoint(_Entry[AsyncClient, AsyncRunHandle]):
    """The asyncio entry point: as Holdpoint, with `async with hp.run(...)`, `await
    run.act(...)` and `@hp.action` on `async def` functions. Use one per event loop."""

    def __init__(self, url: str, token: str, **options: Any) -> None:
        super().__init__(**_settings(options))
        self.client = AsyncClient(url, token, **options)

    @classmethod
    def from_env(cls, **options: Any) -> AsyncHoldpoint:
        return cls(*_env(), **options)

    def _handle(self, thread_id: str, **settings: Any) -> AsyncRunHandle:
        return AsyncRunHandle(self.client, thread_id, **settings)

    async def aclose(self) -> None:
        await self.client.aclose()

    async def __aenter__(self) -> AsyncHoldpoint:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


_SETTINGS = ("owner", "ttl", "lease_timeout", "approval_timeout", "resolution_timeout")


def _settings(options: dict[str, Any]) -> dict[str, Any]:
    """Take the entry point's own settings out of `options` (the rest is the client's)."""
    return {name: options.pop(name) for name in _SETTINGS if name in options}


def _env() -> tuple[str, str]:
    try:
        return os.environ["HOLDPOINT_URL"], os.environ["HOLDPOINT_TOKEN"]
    except KeyError as missing:
        raise HoldpointError(f"{missing.args[0]} is not set") from None
