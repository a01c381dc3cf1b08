"""The OpenAI Agents SDK on Holdpoint: approval-gated tools that act exactly once.

    from holdpoint_client.openai_agents import holdpoint_tool, run_agent

    @holdpoint_tool("agent.tasks.create")           # instead of @function_tool
    async def create_task(title: str, *, call: ToolCall) -> dict: ...

    output = await run_agent(hp, "thread-42", agent, "Review the change", graph="api-review")

Install with `pip install -e ".[openai-agents]"` in the checkout; `import holdpoint_client`
itself never imports the SDK. Why each piece is where it is:

- `needs_approval` is the tenant's policy, not a flag in the agent's code: the wrapper
  prepares the call as a Holdpoint action (key: the run, its goal revision and the SDK's
  `call_id`) and the SDK pauses exactly when the server holds the action for a reviewer.
- The paused `RunState` is written into the Holdpoint run's checkpoint (fenced,
  compare-and-swap), not kept in the process: a restarted agent, or another machine, loads
  it and resumes from the reviewer's decision as the inbox recorded it — approved (the
  ledger then hands the tool the approved params, a reviewer's edits included) or rejected
  (`RunState.reject` with the reviewer's reason, which is what the model reads next).
- The tool body runs only through the ledger (`run.act` with the call id as label): after a
  crash the recorded outcome is returned, an uncertain one is settled as the tool's dedup
  contract says (same Idempotency-Key, lookup, or a person), and the function is not called
  a second time for an effect that happened.
- The model's answers are recorded in the run (holdpoint_client/openai_answers.py): a
  restart is given the same answers, so the same call ids and keys — a real model asked
  again would name new ones, and the ledger would see new actions.
- The thread's input is stored in the run's checkpoint too, before the agent starts: a
  hold point may arise only when a call is dispatched (a policy tightened after the SDK
  asked, an approval that stopped binding), where the SDK has not paused and no RunState
  exists. Resumed without the input, the thread starts from the stored one, the recorded
  answers replayed up to the held call, which the SDK now asks about and pauses on (or
  runs, approved) — the same story as a pause it took itself.
- A pause (or a start) taken under an older goal revision is not resumed: ActionWithdrawn,
  and it is dropped, so the thread starts again under the new goal.
- The final output is recorded in the run, which is completed on return: running the same
  thread again returns it without asking the model or the tools anything.

Resuming: `run_agent` waits for the decision itself (long-poll, lease heartbeated), which is
what a script wants. A service that should not hold a process per paused run passes
`approval_timeout=0` (it returns by raising `ApprovalTimeout`, everything kept) and calls
`run_agent` again for the thread when Holdpoint's signed `approval.decided` webhook arrives
(it only wakes the agent: the decision is read from the server, not from the webhook body);
`wait_for_decision` long-polls a paused thread's approvals without taking its lease.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from agents import (
    Agent,
    FunctionTool,
    RunConfig,
    RunContextWrapper,
    Runner,
    RunResult,
    RunState,
    UserError,
)
from agents.function_schema import function_schema
from agents.items import ToolApprovalItem
from agents.tool_context import ToolContext
from pydantic import BaseModel, ValidationError

from holdpoint_client import calls
from holdpoint_client.agent import (
    STEP,
    AsyncHoldpoint,
    AsyncRunHandle,
    Proof,
    current_run,
    external_run,
)
from holdpoint_client.errors import (
    ActionWithdrawn,
    ApprovalTimeout,
    ExecutorError,
    HoldpointError,
    InvalidParams,
    Rejected,
    ToolRefused,
    VersionConflict,
)
from holdpoint_client.faults import fault
from holdpoint_client.flow import Flow, adrive, ask
from holdpoint_client.models import Action, Approval
from holdpoint_client.openai_answers import Answers, recording
from holdpoint_client.toolcall import ToolCall

__all__ = ["STATE_KEY", "holdpoint_tool", "label_of", "run_agent", "wait_for_decision"]

# Where the paused RunState lives in the run's checkpoint state, and the final output's record.
STATE_KEY = "openai_agents"
# Beside it: the goal revision its paused calls were keyed under. A revision since then
# withdrew them, and only this key finds them again to say so.
PAUSED_UNDER = "openai_agents_goal_rev"
# And how many model answers the paused run had used: where its answers' numbering goes on.
ANSWERED = "openai_agents_answers"
# The thread's input and the goal revision it was started under, stored before the agent
# starts: a call held only at its dispatch leaves no SDK pause, and the webhook's
# `run_agent(hp, thread_id, agent)` starts from this input, the recorded answers replayed.
STARTED = "openai_agents_input"
FINAL = "openai-agents:final"
Reason = str | Callable[..., str]
# The `on_invoke_tool` of every tool holdpoint_tool made: how a paused call is known as ours.
_LEDGERED: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()


def label_of(call_id: str) -> str:
    """The ledger label of one SDK tool call: its key is `<run>:<goal_rev>:ext:oa:<call_id>`,
    the same in every process that meets this call."""
    return f"oa:{call_id}"


def _run() -> AsyncRunHandle:
    run = current_run()
    if not isinstance(run, AsyncRunHandle):
        raise ExecutorError("Holdpoint tools run inside run_agent(...) (an AsyncHoldpoint run)")
    return run


def _prepared(
    run: AsyncRunHandle, tool: str, params: Mapping[str, Any], label: str, reason: str, target: str
) -> Flow[Action]:
    """The call's action, found by its key or prepared now (the policy decides there)."""
    goal_rev = run.ex.goal_rev
    key = run.ex.key_for(label, goal_rev)
    found = yield from ask(calls.actions_page(idempotency_key=key))
    if found.results:
        return found.results[0]
    return (yield from run.ex._prepare(key, tool, params, reason, target, goal_rev=goal_rev))


def holdpoint_tool(
    tool: str,
    *,
    name: str | None = None,
    description: str | None = None,
    reason: Reason | None = None,
    lookup: Callable[[ToolCall], Any] | None = None,
    external_id: Proof = "id",
    target: str = "",
    strict: bool = True,
) -> Callable[[Callable[..., Any]], FunctionTool]:
    """Make `fn` an SDK `FunctionTool` whose calls are the Holdpoint tool `tool`'s actions.

    The model sees `fn`'s signature and docstring, as with `@function_tool` (minus `call`).
    `fn` runs with the *approved* params, validated by its signature as `@function_tool`
    does (the action's params are those arguments, defaults included), plus `call=` (the
    ToolCall: `call.headers()` carry the ledger's Idempotency-Key) if it declares `call`;
    what it returns (JSON) is recorded and given to the model. `reason` (text, or a function of the
    params; default the docstring's first line) is what the reviewer reads; `lookup` and
    `external_id` are `run.act`'s. Exceptions propagate and stop the run (nothing is sent to
    the model as if it were an answer): a Holdpoint error means the ledger must decide.
    """

    def wrap(fn: Callable[..., Any]) -> FunctionTool:
        signature = inspect.signature(fn)
        takes_call = "call" in signature.parameters
        why = reason or (inspect.getdoc(fn) or tool).splitlines()[0]

        @functools.wraps(fn)
        def visible(*args: Any, **kwargs: Any) -> Any:  # never called: the model's view of fn
            raise NotImplementedError

        # The model never fills `call`: the schema is made from the signature without it.
        visible.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[p for n, p in signature.parameters.items() if n != "call"]
        )
        visible.__annotations__ = {
            k: v for k, v in getattr(fn, "__annotations__", {}).items() if k != "call"
        }
        schema = function_schema(
            visible,
            name_override=name,
            description_override=description,
            strict_json_schema=strict,
        )

        def reason_for(params: Mapping[str, Any]) -> str:
            return why(**params) if callable(why) else why

        shown = inspect.signature(visible).parameters.values()
        by_name = all(p.kind not in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL) for p in shown)
        positional = [p.name for p in shown if p.kind is p.POSITIONAL_OR_KEYWORD]

        def ledgered(params: dict[str, Any]) -> dict[str, Any]:
            """The params the ledger holds: `fn`'s arguments as `@function_tool` makes them
            (validated, defaults filled in), as JSON — what a reviewer approves and the hash
            binds is what `fn` runs with. A default of None ("absent") the model left out
            stays out: a tool's schema may refuse null, and `fn` gets None all the same."""
            model = schema.params_pydantic_model.model_validate(params)
            return {
                k: v
                for k, v in model.model_dump(mode="json").items()
                if v is not None or k in params
            }

        def arguments(params: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any]]:
            """`fn`'s arguments from the approved params, as `@function_tool` calls it (an
            enum a member, a date a date), by name where the signature allows (`call` may
            stand anywhere in it)."""
            try:
                parsed = schema.params_pydantic_model.model_validate(dict(params))
            except ValidationError as exc:  # a reviewer's edit `fn` cannot take: not sent
                raise ToolRefused(f"the approved params do not fit {schema.name}: {exc}") from exc
            args, kwargs = schema.to_call_args(parsed)
            if by_name:
                return [], {**dict(zip(positional, args, strict=True)), **kwargs}
            return args, kwargs

        async def perform(call: ToolCall) -> Any:
            args, kwargs = arguments(call.params)
            if takes_call:
                kwargs["call"] = call
            if inspect.iscoroutinefunction(fn):
                return await fn(*args, **kwargs)
            return await asyncio.to_thread(fn, *args, **kwargs)

        def misfit(params: Any) -> str:
            """What is wrong with the model's arguments for `fn` ("" if nothing): told to
            the model, as the SDK's own function tools tell it, before anything is prepared —
            a reviewer never sees, nor the ledger keeps, a call the function cannot take."""
            if not isinstance(params, dict):
                return f"Invalid JSON input for tool {schema.name}: not a JSON object."
            try:
                schema.params_pydantic_model.model_validate(params)
            except ValidationError as exc:
                return f"Invalid JSON input for tool {schema.name}: {exc}"
            return ""

        async def needs_approval(
            ctx: RunContextWrapper[Any], params: dict[str, Any], call_id: str
        ) -> bool:
            if misfit(params):
                return False  # invoke tells the model; nothing is prepared for a reviewer
            params = ledgered(params)
            run = _run()
            flow = _prepared(run, tool, params, label_of(call_id), reason_for(params), target)
            try:
                action = await adrive(flow, run.client)
            except InvalidParams:
                return False  # the server's schema refused them: invoke says so
            return action.status == "awaiting_approval" or (
                action.status == "cancelled" and action.approval is not None
            )

        async def invoke(ctx: ToolContext[Any], arguments: str) -> Any:
            run = _run()
            try:
                params = json.loads(arguments or "{}", parse_constant=_not_json)
            except ValueError as exc:
                return _retry_with(f"Invalid JSON input for tool {schema.name}: {exc}")
            wrong = misfit(params)
            if wrong:
                return _retry_with(wrong)
            params = ledgered(params)
            try:
                result = await run.act(
                    tool,
                    params,
                    reason=reason_for(params),
                    perform=perform,
                    lookup=lookup,
                    label=label_of(ctx.tool_call_id),
                    target=target,
                    external_id=external_id,
                )
            except Rejected as rejected:  # decided after the SDK let the call through
                return _rejection(rejected.reason)
            except InvalidParams as refused:  # the tool's own schema, stricter than fn's
                return _retry_with(f"{schema.name}: {refused.detail} {refused.errors or ''}")
            return json.dumps(result)

        _LEDGERED.add(invoke)
        return FunctionTool(
            name=schema.name,
            description=schema.description or "",
            params_json_schema=schema.params_json_schema,
            on_invoke_tool=invoke,
            strict_json_schema=strict,
            needs_approval=needs_approval,
        )

    return wrap


def _not_json(constant: str) -> Any:
    """NaN and Infinity, which Python's json takes and JSON (and the API) does not."""
    raise ValueError(f"{constant} is not JSON")


def _unreadable(item: ToolApprovalItem) -> bool:
    """Whether the paused call's arguments are not a JSON object (as the SDK reads them)."""
    raw = item.raw_item
    arguments = raw.get("arguments") if isinstance(raw, Mapping) else getattr(raw, "arguments", "")
    try:
        return not isinstance(json.loads(str(arguments or ""), parse_constant=_not_json), dict)
    except ValueError:
        return True


def _ledgered(item: ToolApprovalItem) -> bool:
    """Whether a paused call is one of a holdpoint_tool: a FunctionTool of the pausing
    agent, by the call's tool name, whose invoker is one holdpoint_tool made."""
    for found in getattr(item.agent, "tools", ()):
        if isinstance(found, FunctionTool) and found.name == item.tool_name:
            return found.on_invoke_tool in _LEDGERED
    return False


def _retry_with(problem: str) -> str:
    """What the SDK's default failure function tells a model whose call failed."""
    return f"An error occurred while running the tool. Please try again. Error: {problem}"


def _rejection(reason: str) -> str:
    return f"A reviewer rejected this call: {reason}" if reason else "A reviewer rejected it."


def _withdrawal(refusal: Exception) -> str:
    return f"This call was not run: {refusal}"


def _call_id(item: ToolApprovalItem) -> str:
    raw = item.raw_item
    found = raw.get("call_id") if isinstance(raw, Mapping) else getattr(raw, "call_id", None)
    if not found:
        raise ExecutorError(f"the SDK's approval of {item.name} names no call id")
    return str(found)


async def _decide(
    run: AsyncRunHandle, state: RunState[Any, Any], goal_rev: int, timeout: float | None
) -> None:
    """Apply the inbox's decisions to the paused state, waiting for them (up to `timeout`
    s; ApprovalTimeout leaves everything as it is for the next try). `goal_rev`: the
    revision the pause was taken under, whose keys its calls have."""
    deadline = None if timeout is None else time.monotonic() + timeout
    if goal_rev != run.ex.goal_rev:
        # Paused under an older goal: its calls were withdrawn (or, sent before the
        # revision, stay the old goal's). Approving one would prepare it again under the
        # new revision — a second effect nobody asked for under the new goal.
        raise await _withdrawn(run, state, goal_rev)
    for item in state.get_interruptions():
        key = run.ex.key_for(label_of(_call_id(item)), goal_rev)
        page = await run.client.send(calls.actions_page(idempotency_key=key))
        if not page.results and _ledgered(item) and _unreadable(item):
            # The SDK holds a call whose arguments are not a JSON object without asking
            # needs_approval, so nothing was prepared: let it through to invoke, which
            # prepares nothing for them either and tells the model what is wrong.
            state.approve(item)
            continue
        if not page.results:
            raise ExecutorError(
                f"the SDK paused for {item.name}, which is not a Holdpoint tool: approve it "
                "in your own code, or wrap it with holdpoint_tool"
            )
        action = page.results[0]
        while action.status == "awaiting_approval":
            action = await adrive(run.ex._await_decision(action, deadline), run.client)
        if action.status == "cancelled":
            refusal = await adrive(run.ex._cancelled(action), run.client)
            if isinstance(refusal, Rejected):
                state.reject(item, rejection_message=_rejection(refusal.reason))
                continue
            run.state = await adrive(run._load(), run.client)  # the run as it is now
            if goal_rev != run.ex.goal_rev:  # withdrawn by a revision: the old goal's pause
                await _store(run, drop=True)
                raise refusal
            if run.ex._run is None or run.ex._run.finished:  # cancelled: nothing goes on
                raise refusal
            # Withdrawn by its hold point (the approval expired, the policy rejecting at
            # expiry): the model is told, as of a rejection, and the agent goes on — as a
            # hosted graph's step reads it. Raised, the stored pause would raise it again
            # on every later run_agent, and the thread could never go on.
            state.reject(item, rejection_message=_withdrawal(refusal))
        else:  # approved, or already sent/confirmed by a predecessor: the ledger goes on
            if action.status == "approved":  # decided before we looked, too: nothing sent yet
                fault("after_decision")
            state.approve(item)


async def _withdrawn(run: AsyncRunHandle, state: RunState[Any, Any], goal_rev: int) -> Exception:
    """The refusal of a pause taken under an older goal revision, which is dropped from the
    run's checkpoint first: the thread starts again under the new goal from a new input."""
    first: Action | None = None
    for item in state.get_interruptions():
        key = run.ex.key_for(label_of(_call_id(item)), goal_rev)
        page = await run.client.send(calls.actions_page(idempotency_key=key))
        first = first or (page.results[0] if page.results else None)
    await _store(run, drop=True)
    return ActionWithdrawn(
        f"the goal was revised (revision {goal_rev} to {run.ex.goal_rev}) while the agent was "
        "paused: its calls are withdrawn; run the thread again with an input for the new goal",
        action=first,
    )


_STORED = (STATE_KEY, PAUSED_UNDER, ANSWERED, STARTED)


async def _store(
    run: AsyncRunHandle, pause: dict[str, Any] | None = None, *, drop: bool = False
) -> None:
    """Write a pause (the RunState, the goal revision its calls were keyed under, the model
    answers it had used) or the thread's input into the run's checkpoint before anyone
    waits on it — or `drop` what is stored of the thread's start and pause."""
    for _ in range(3):
        kept = {k: v for k, v in run.state.items() if k not in _STORED}
        state = kept if drop else {**run.state, **(pause or {})}
        try:
            await adrive(run.ex._checkpoint_flow(state, STEP), run.client)
        except VersionConflict:  # someone wrote meanwhile (the server, a reviewer)
            run.state = await adrive(run._load(), run.client)
            continue
        run.state = state
        return
    raise ExecutorError("could not store the paused run state: the checkpoint kept moving")


def _paused_under(run: AsyncRunHandle) -> int:
    """The goal revision the stored pause was taken under (the current one for a pause
    stored by a client that did not note it)."""
    under = run.state.get(PAUSED_UNDER)
    return under if isinstance(under, int) else run.ex.goal_rev


def _answered(run: AsyncRunHandle) -> int:
    """How many model answers the stored pause had used (0 for a client that did not note
    it: that client recorded none)."""
    taken = run.state.get(ANSWERED)
    return taken if isinstance(taken, int) else 0


async def _started(run: AsyncRunHandle, thread_id: str, input: Any) -> Any:
    """What a thread with no stored pause starts from: its stored input (a restart, or the
    webhook's call after a call held at its dispatch — `input` is then ignored, as with a
    pause: the recorded answers are that input's), else `input`, stored first. An input
    stored under an older goal revision is not started again: without a new input, the
    held call it led to is withdrawn (ActionWithdrawn), as an older revision's pause is."""
    stored = run.state.get(STARTED)
    if isinstance(stored, Mapping) and "input" in stored:
        if stored.get("goal_rev") == run.ex.goal_rev:
            return stored["input"]
        if input is None:
            await _store(run, drop=True)
            raise ActionWithdrawn(
                f"the goal was revised (revision {stored.get('goal_rev')} to "
                f"{run.ex.goal_rev}) since thread {thread_id!r} started: its calls are "
                "withdrawn; run the thread again with an input for the new goal"
            )
    if input is None:
        raise ExecutorError(f"thread {thread_id!r} has no paused agent: pass the input")
    await _store(run, {STARTED: {"input": _as_json(input), "goal_rev": run.ex.goal_rev}})
    return input


def _as_json(input: Any) -> Any:
    """The SDK's input (text, or input items: dicts or the SDK's pydantic models) as JSON."""
    if isinstance(input, list):
        input = [
            item.model_dump(mode="json", exclude_unset=True, by_alias=True)
            if isinstance(item, BaseModel)
            else item
            for item in input
        ]
    return json.loads(calls.dumps(input))


async def _never() -> Any:
    raise ExecutorError("the run finished without recording the agent's final output")


async def _run_agent(agent: Agent[Any], start: Any, runner: dict[str, Any]) -> RunResult:
    """`Runner.run`, raising what a tool's call raised as itself: the SDK wraps a tool's
    exception in `UserError("Error running tool …")`, and a caller must be able to tell an
    OutcomeUnknown ("do not do it again yourself") or a LeaseLost ("stop") from a bug."""
    try:
        return await Runner.run(agent, start, **runner)
    except UserError as wrapped:
        if isinstance(wrapped.__cause__, HoldpointError):
            raise wrapped.__cause__ from None
        raise


async def run_agent(
    hp: AsyncHoldpoint,
    thread_id: str,
    agent: Agent[Any],
    input: Any = None,
    *,
    graph: str,
    goal: Any = None,
    approval_timeout: float | None = None,
    **runner: Any,
) -> Any:
    """`Runner.run(agent, input, **runner)` as the Holdpoint run of `thread_id`; returns the
    final output (recorded, JSON).

    The run is found again by `thread_id` (or created, external, with `goal`). A paused
    RunState stored in it is resumed — `input` is then ignored — after the reviewers'
    decisions are applied; each new pause is stored, then waited for. With no pause stored,
    the thread starts from the input stored when it first started (`input` ignored), or
    from `input`, stored first — so a call held only at its dispatch resumes without the
    input, its model answers replayed from the record. `approval_timeout`:
    seconds to wait for a decision (None: the AsyncHoldpoint's `approval_timeout` — as long
    as it takes if that is None too; 0: not at all — a service calls again on the
    `approval.decided` webhook); ApprovalTimeout keeps everything. It bounds every wait for a
    reviewer: a stored pause's, and a call's that the server holds again when it is sent.
    A completed run returns its recorded output without running anything.
    """
    async with hp.run(thread_id, graph=graph, goal=goal) as run:
        # A tool's `run.act` waits with the run's timeout for a hold point met at the
        # dispatch (a policy tightened after the SDK asked, an approval that stopped
        # binding): it must be this one, or a service that asked not to be held is held.
        if approval_timeout is not None:
            run.approval_timeout = approval_timeout
        approval_timeout = run.approval_timeout
        if run.finished:
            return await run.record(FINAL, _never)
        saved = run.state.get(STATE_KEY)
        answers = Answers(run, run.ex.goal_rev)
        config = runner.pop("run_config", None) or RunConfig()
        recorded, runner["run_config"] = recording(agent, config, answers)
        start: Any
        if isinstance(saved, Mapping):
            paused: RunState[Any, Any] = await RunState.from_json(recorded, dict(saved))
            await _decide(run, paused, _paused_under(run), approval_timeout)
            answers.taken = _answered(run)
            start = paused
        else:
            start = await _started(run, thread_id, input)
        while True:
            under = run.ex.goal_rev  # what the calls Runner.run prepares are keyed under
            result = await _run_agent(recorded, start, runner)
            if not result.interruptions:
                break
            paused = result.to_state()
            pause = {STATE_KEY: paused.to_json(), PAUSED_UNDER: under, ANSWERED: answers.taken}
            await _store(run, pause)
            await _decide(run, paused, under, approval_timeout)
            start = paused
        final = result.final_output

        async def output() -> Any:
            return final

        return await run.record(FINAL, output)


async def wait_for_decision(
    hp: AsyncHoldpoint, thread_id: str, *, timeout: float | None = None
) -> list[Approval]:
    """Long-poll until no approval of the thread's run is pending; its approvals.

    For a script that resumes a paused agent itself (`run_agent` again) once reviewers
    answered. It takes no lease, so it may run beside the agent or in another process.
    The run is the one `run_agent` resumes — the thread's external run — not a hosted run
    that shares the thread id (its approvals are not the agent's). Raises ApprovalTimeout
    after `timeout` seconds with a decision still pending, ExecutorError for a thread with
    no external run.
    """
    client = hp.client
    deadline = None if timeout is None else time.monotonic() + timeout
    run = await adrive(external_run(thread_id), client)
    if run is None:
        raise ExecutorError(
            f"thread {thread_id!r} has no external run (run_agent starts one): nothing of "
            "the agent's waits for a decision; a hosted run's approvals are not the agent's"
        )
    decided: list[Approval] = []
    async for action in client.run_actions(run.run_id):
        if action.approval is None:
            continue
        approval = await client.get_approval(action.approval)
        while approval.pending:
            wait = 30.0
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ApprovalTimeout(f"approval {approval.id} is still pending", action=action)
                wait = max(1.0, min(wait, left))
            approval = await client.get_approval(approval.id, wait=wait)
        decided.append(approval)
    return decided
