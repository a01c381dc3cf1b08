"""The parts of the LangGraph adapter (holdpoint_client.langgraph) that do no I/O of their own:
what a tool call, its interrupt and its answer are, read and written the same way by the
blocking (`wrap_tool_call`) and the asyncio (`awrap_tool_call`) path. The one query they
make (`not_of_an_older_goal`) is a flow (holdpoint_client.flow), driven by either.
"""

from __future__ import annotations

import contextvars
import inspect
import json
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.messages import ToolCall as LangChainToolCall
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool
from langgraph.prebuilt import ToolNode
from langgraph.prebuilt.tool_node import TOOL_CALL_ERROR_TEMPLATE, ToolCallRequest
from langgraph.types import Command, Interrupt, StateSnapshot
from pydantic import BaseModel, ValidationError
from pydantic_core import to_jsonable_python

from holdpoint_client import calls
from holdpoint_client.agent import AsyncHoldpoint, Holdpoint, Proof, RunCore, proved
from holdpoint_client.calls import API_PREFIX
from holdpoint_client.errors import ActionWithdrawn, ExecutorError
from holdpoint_client.flow import Flow, ask
from holdpoint_client.models import Approval
from holdpoint_client.toolcall import ToolCall

KIND = "holdpoint.approval"  # the `type` of the interrupt values this module raises
TURN = "holdpoint_turn"  # the checkpoint metadata key naming the turn of `invoke(turn=...)`

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
    # threading.Lock (ToolNode's threads) or asyncio.Lock (its tasks), as the client's driver
    lock: Any = field(default_factory=threading.Lock)
    asked: bool = False
    interrupted: tuple[Interrupt, ...] = ()
    surfaced: set[str] = field(default_factory=set)  # tool_call ids


class ToolErrored(Exception):
    """The tool node turned an exception of the tool into an error message: whether the
    effect happened cannot be told from it, so the server's reconcile decides."""


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


def request_page(hp: Holdpoint | AsyncHoldpoint, approval_id: str) -> str:
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


def not_of_an_older_goal(run: RunCore[Any], label: str) -> Flow[None]:
    """Refuse a call the model asked for before the goal was last revised: its action (under
    the older revision's key) was withdrawn, or sent for the old goal — preparing it again
    under the new key would be a second effect the new goal never asked for. Runs never
    revised (goal_rev 1) ask nothing; a revised one asks once per older revision."""
    for goal_rev in range(run.ex.goal_rev - 1, 0, -1):
        key = run.ex.key_for(label, goal_rev)
        page = yield from ask(calls.actions_page(idempotency_key=key))
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
