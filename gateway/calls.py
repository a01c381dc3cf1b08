"""The gateway's synchronous core: who calls, the session's run, and one `tools/call`.

Everything here is a short database operation (or one upstream call inside
`runtime.dispatch.perform`), run by `gateway.server` on a worker thread with its own
connection, closed when it returns: a call waiting for a reviewer holds neither a thread
nor a connection between its polls.

**A session is a run.** `initialize` starts an external run of the built-in graph
`mcp-session` (runtime/agents/mcp_session.py) whose executor account is the token's agent;
its id is the `Mcp-Session-Id`. Any later request naming it — after a restart too — is
served in that run, for an agent token of the same account; another agent's, another
tenant's, or a finished run's id is not found (the client then opens a new session).

**One call is one action** of the run's step `api`, prepared, held and dispatched with the
executor protocol's own functions (runtime.protocol: `take` → `prepare` → `dispatch`, which
sends `http`/`mcp` tools through `runtime.dispatch.perform` — the fault points included),
under a lease taken for that call alone and released after it.

**The same call.** MCP has no idempotency key, and a client retrying after a lost or
pending answer sends a new JSON-RPC id. So the call is named by what it asks: the session,
the tool and the canonical arguments. An identical call finds the earlier one's action —
while it waits for a reviewer, while it is being sent, once decided, and after a lost
answer — until that action's final outcome (a result, a rejection, a refusal) has been
handed to the client (a `result_delivered` journal entry); the next identical call after
that is a new action. The key is `mcp:<run>:<call hash>:<n>`, n = 1 + the finals already
delivered for that call hash. The weak spot, documented: a final answer lost on the wire
after it was marked delivered makes the client's retry a new action (held again if the
tool is held).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.urls import reverse

from approvals.models import ApprovalPolicy, ApprovalRequest
from audit import journal
from audit.models import JournalEntry
from runtime import actionkeys, ledger, protocol, toolcatalog
from runtime.agents import mcp_session
from runtime.agents.mcp_session import NAME as GRAPH
from runtime.dispatch import reconcile_due
from runtime.errors import (
    AlreadyCompleted,
    ApprovalExpired,
    ApprovalRequired,
    HoldpointError,
    InvalidParams,
    LeaseHeld,
    RunFinished,
    ToolUnavailable,
)
from runtime.events import RunEvent, record
from runtime.lifecycle import create_run
from runtime.models import TERMINAL, Action, ActionStatus, AgentToken, Run, Tenant
from runtime.storable import storable_text
from runtime.tools import Effect, Sender, Tool, get_tool, tool_of

S = ActionStatus
# The executors whose tools the gateway can perform itself; `client` tools are the agent's.
SENT_HERE = (Sender.HTTP, Sender.MCP)
# How long a call's lease outlives the tool's own timeout: a gateway process that dies
# mid-call blocks the next call of its session for at most this long past the timeout.
LEASE_MARGIN = 5.0
# One lease owner per gateway process (and per start of it): a restarted process is a new
# executor, so the protocol's takeover rules settle what the dead one left `sent`.
OWNER = f"mcp-gateway:{os.getpid()}:{uuid.uuid4().hex[:8]}"
# What the call finally came to: the client has its answer once one of these is handed out.
FINAL = (S.CONFIRMED, S.FAILED, S.CANCELLED, S.COMPENSATED)


class Refused(Exception):
    """Not authenticated (401) or not for this endpoint (403): refused before any session."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


class CallError(Exception):
    """A call the gateway will not take (unknown tool, invalid or oversized arguments): an
    MCP error (JSON-RPC `code`), nothing stored and nothing sent."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code, self.message, self.data = code, message, data


INVALID_PARAMS = -32602


class Busy(Exception):
    """Another call of the session holds the run's lease: try again in a moment."""


class Ended(Exception):
    """The session's run finished (cancelled, closed by a DELETE or the idle sweep) after
    the endpoint let this request in: answered as a finished session is at the door."""


@dataclass(frozen=True)
class Caller:
    """An authenticated agent token at its tenant's endpoint."""

    user_id: int
    username: str
    tenant_id: int
    token_prefix: str

    @property
    def who(self) -> str:
        return f"agent:{self.username}"


def authenticate(header: str, slug: str) -> Caller:
    """`Authorization: Bearer <key>` (or `Token <key>`, the API's spelling) of a usable
    agent token (runtime.models.AgentToken: not revoked or expired, an agent account of
    an active tenant — a person's token never authenticates) whose tenant is the endpoint's.
    Every bad key reads the same, as on the API."""
    parts = header.split()
    if len(parts) != 2 or parts[0].lower() not in ("bearer", "token"):
        raise Refused(401, "an agent token is required: Authorization: Bearer <key>")
    token = AgentToken.objects.authenticate(parts[1])
    if token is None:
        raise Refused(401, "Invalid token.")
    if token.tenant.slug != slug:
        raise Refused(403, "this token is not for this tenant's MCP endpoint")
    token.touch()
    return Caller(token.user_id, token.user.get_username(), token.tenant_id, token.prefix)


def open_session(caller: Caller, client: dict[str, Any]) -> str:
    """A new session: a new external run of `mcp-session`, executed by the caller's agent
    account. Its id is the session id; its goal keeps the client's name and version — as
    text a goal can hold (a NUL, which JSON lets a client send, as U+FFFD: the session is
    not refused after the SDK said yes)."""
    tenant = Tenant.objects.get(pk=caller.tenant_id)
    user = User.objects.get(pk=caller.user_id)
    about = {k: storable_text(str(v)[:200]) for k, v in client.items() if k in ("name", "version")}
    run = create_run(
        tenant,
        GRAPH,
        {"client": about},
        actor=caller.who,
        thread_id=f"mcp-{uuid.uuid4()}",
        external=True,
        executor_account=user,
    )
    return str(run.run_id)


def adopt(caller: Caller, session_id: str) -> str:
    """The session `session_id` names — an unfinished session run of the caller's own
    account (a restart loses nothing: the run is the session) — as its run id is written,
    else "". A UUID may be spelled several ways (upper case, braces, no hyphens); the calls'
    keys and their delivered answers are the run's, so they are named by its one spelling:
    under the client's, a delivered answer was not found again and the next identical call
    got the previous one's result instead of being made."""
    try:
        run_id = uuid.UUID(session_id)
    except ValueError:
        return ""
    found = (
        Run.objects.filter(
            pk=run_id,
            tenant_id=caller.tenant_id,
            graph=GRAPH,
            external=True,
            executor_account_id=caller.user_id,
        )
        .exclude(status__in=TERMINAL)
        .exists()
    )
    return str(run_id) if found else ""


def close_session(caller: Caller, session_id: str) -> bool:
    """The client ends its session (HTTP DELETE, which the SDK's client sends whenever it
    closes): `mcp_session.close` — the run completes if every call of it has had its final
    answer delivered, else it stays open. Whether the run was completed."""
    run = Run.objects.get(pk=session_id, tenant_id=caller.tenant_id)
    try:
        return mcp_session.close(run, OWNER, caller.who, "client")
    except LeaseHeld:
        raise Busy() from None


# --- tools/list --------------------------------------------------------------------------


@dataclass(frozen=True)
class Listed:
    name: str
    description: str
    schema: dict[str, Any]
    title: str = ""


def listing(caller: Caller) -> list[Listed]:
    """The tenant's tools the gateway performs (http definitions, and mcp definitions of an
    active server: an inactive one's are not sent), each description saying when a call
    waits for a reviewer."""
    held_by_policy = set(
        ApprovalPolicy.objects.filter(
            tenant_id=caller.tenant_id, active=True, required=True
        ).values_list("tool", flat=True)
    )
    found = []
    for entry in toolcatalog.offered(caller.tenant_id):
        spec = entry.spec
        if spec.get("executor", Sender.HTTP) not in SENT_HERE:
            continue
        note = _hold_note(entry, held_by_policy)
        text = " ".join(part for part in (str(spec.get("description", "")), note) if part)
        found.append(
            Listed(
                entry.name,
                text,
                dict(spec.get("schema") or {"type": "object"}),
                str(spec.get("title", "")),
            )
        )
    return found


def _hold_note(entry: toolcatalog.Entry, held_by_policy: set[str]) -> str:
    if entry.approval_by_default:
        return "[Holdpoint: every call waits for a reviewer's approval before it is sent.]"
    if entry.name in held_by_policy:
        return "[Holdpoint: a call may wait for a reviewer's approval (a policy holds it).]"
    if entry.spec.get("effect", Effect.WRITE) == Effect.READ:
        return ""
    return "[Holdpoint: sent at once (a policy lets it go), recorded in the audit trail.]"


# --- tools/call --------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One call as the gateway names it (see the module's "the same call")."""

    run_id: str
    tenant_id: int
    tool: str
    params: dict[str, Any]
    call_hash: str
    key: str


def parse(caller: Caller, run_id: str, name: str, arguments: Any) -> Call:
    """Validate the call before anything is stored: a tool the gateway performs, arguments
    within HOLDPOINT_MCP_MAX_ARGUMENT_BYTES that canonicalise and fit the tool's schema.
    CallError otherwise."""
    tool = _tool(caller, name)
    params = {} if arguments is None else arguments
    try:
        canonical = actionkeys.canonical_params(params)
    except InvalidParams as exc:
        raise CallError(INVALID_PARAMS, f"invalid arguments: {exc.detail}") from None
    limit = settings.HOLDPOINT_MCP_MAX_ARGUMENT_BYTES
    if len(canonical.text.encode("utf-8")) > limit:
        raise CallError(INVALID_PARAMS, f"arguments larger than {limit} bytes (canonical JSON)")
    try:
        tool.validate(params)
    except InvalidParams as exc:
        raise CallError(
            INVALID_PARAMS, f"invalid arguments for {name}: {exc.detail}", exc.extra.get("errors")
        ) from None
    call_hash, key = _named(run_id, caller.tenant_id, tool.name, canonical)
    server = toolcatalog.withheld(tool, caller.tenant_id)
    if server and ledger.by_key(caller.tenant_id, key) is None:  # a call made before: its answer
        raise CallError(
            INVALID_PARAMS,
            f"{name} is not available: its MCP server {server!r} is inactive (nothing was sent)",
        )
    return Call(run_id, caller.tenant_id, tool.name, params, call_hash, key)


def _named(
    run_id: str, tenant_id: int, tool: str, canonical: actionkeys.Canonical
) -> tuple[str, str]:
    """The call's hash and its action's key (see "the same call"), by its arguments'
    fingerprint — or by their fingerprint in the form before RFC 8785 (actionkeys.Canonical)
    while an action of this session holds them in it unanswered: the call was made before
    the upgrade, and its retry after it must find that action, not prepare a second one."""
    named = []
    for fingerprint in canonical.fingerprints():
        call_hash = hashlib.sha256(f"{tool}\n{fingerprint}".encode()).hexdigest()[:32]
        delivered = _delivered(run_id, tenant_id, call_hash).count()
        named.append((call_hash, f"mcp:{run_id}:{call_hash}:{delivered + 1}"))
    for earlier in named[1:]:
        if ledger.by_key(tenant_id, earlier[1]) is not None:
            return earlier
    return named[0]


def _tool(caller: Caller, name: str) -> Tool:
    if not isinstance(name, str) or toolcatalog.entry(caller.tenant_id, name) is None:
        raise CallError(INVALID_PARAMS, f"unknown tool: {str(name)[:100]}")
    try:
        tool = get_tool(name, caller.tenant_id)
    except InvalidParams:
        raise CallError(INVALID_PARAMS, f"unknown tool: {name}") from None
    if tool.executor not in SENT_HERE:
        raise CallError(INVALID_PARAMS, f"{name} is performed by the agent, not the gateway")
    return tool


def _delivered(run_id: str, tenant_id: int, call_hash: str) -> Any:
    return JournalEntry.objects.filter(
        stream=journal.run_stream(run_id),
        tenant_id=tenant_id,
        type=RunEvent.RESULT_DELIVERED.value,
        payload__call=call_hash,
    )


def drive(caller: Caller, call: Call) -> Action:
    """Take the call as far as it goes now: find or prepare its action, send it if it may
    go, settle what a dead gateway left `sent`. Busy if another call holds the session;
    Ended if it finished meanwhile."""
    action = ledger.by_key(call.tenant_id, call.key)
    if action is not None and action.status not in (S.PREPARED, S.APPROVED, *ledger.UNSETTLED):
        return action  # waiting for a reviewer or a person, or settled: nothing to do now
    if action is not None and action.status in ledger.UNSETTLED and not reconcile_due(action):
        # A lookup that could not tell is asked again on the worker's schedule, not on every
        # poll of a waiting call: HOLDPOINT_RECONCILE_ATTEMPTS polls would hand a finder that
        # failed for a few seconds to a person.
        return action
    if action is not None and _not_yet(action):
        return action
    tool = get_tool(call.tool, call.tenant_id)
    try:
        return _drive_leased(caller, call, action, tool.timeout + LEASE_MARGIN)
    except (RunFinished, AlreadyCompleted):
        raise Ended() from None


def _drive_leased(caller: Caller, call: Call, action: Action | None, ttl: float) -> Action:
    """`drive` under the session run's lease: prepare the call's action if it has none, send
    it if it may go."""
    with _lease(caller, call.run_id, ttl) as (run, fence):
        if action is None:
            action, _ = protocol.prepare(
                run,
                fence,
                call.tool,
                call.params,
                reason=f"called by {caller.who} over MCP",
                who=caller.who,
                idempotency_key=call.key,
            )
        else:
            action = ledger.reload(action)  # the takeover may have settled it
        if action.status in (S.PREPARED, S.APPROVED, *ledger.UNSETTLED):
            unsettled = _unsettled(action)
            try:
                action = protocol.dispatch(action, fence, caller.who)
            except (ApprovalRequired, ApprovalExpired, ToolUnavailable):
                # Held again (asked anew) or, under a policy that rejects at expiry,
                # cancelled: the action's status now is the call's answer.
                action = ledger.reload(action)
            if unsettled is not None and _unsettled(action) == unsettled:
                _absent_for_now(action)  # reconciled, and nothing written: see below
    return action


def _unsettled(action: Action) -> tuple[str, int] | None:
    if action.status not in ledger.UNSETTLED:
        return None
    return action.status, action.reconcile_attempts


# Unsettled actions whose lookup said "absent" while their request could still land (the
# reconciliation then writes nothing; a worker parks its run until the window closes). Not
# asked again by this process until it has: a hint, bounded; the row decides the rest.
_ABSENT_IN_FLIGHT: set[Any] = set()


def _not_yet(action: Action) -> bool:
    """Whether an unsettled action is left alone now, though its back-off is over: its
    request may still land — from its sender (here, in another process, or one paused past
    its lease; taking the lease would refuse the sender's own answer as stale) or after a
    lookup here found it absent — and a lookup can only say "not yet" (the worker's rule,
    dispatch.reconcile_action). Asked again once the request can no longer be in flight."""
    if action.status != S.SENT and action.pk not in _ABSENT_IN_FLIGHT:
        return False
    if ledger.may_be_in_flight(action):
        return True
    _ABSENT_IN_FLIGHT.discard(action.pk)
    return False


def _absent_for_now(action: Action) -> None:
    if len(_ABSENT_IN_FLIGHT) >= 10_000:
        _ABSENT_IN_FLIGHT.clear()
    _ABSENT_IN_FLIGHT.add(action.pk)


@contextmanager
def _lease(caller: Caller, run_id: str, ttl: float) -> Iterator[tuple[Run, int]]:
    """The session run's lease for one call (runtime.protocol.take: the takeover settles a
    dead gateway's `sent` actions first), released afterwards whatever happened."""
    run = Run.objects.get(pk=run_id, tenant_id=caller.tenant_id)
    try:
        lease = protocol.take(run, OWNER, ttl, who=caller.who)
    except LeaseHeld:
        raise Busy() from None
    try:
        yield run, lease.fence
    finally:
        try:
            protocol.release(run, lease.fence, caller.who, owner=OWNER)
        except HoldpointError:
            pass  # taken over meanwhile (the lease ran out): the successor holds it


def settle_delivery(caller: Caller, call: Call, action: Action) -> None:
    """The client is about to get `action`'s final outcome: the next identical call of the
    session is a new one. Journalled once per action, in the run's stream.

    The run's row is locked first, as every writer of a run takes it before the run's
    stream: two identical calls answered at once (a host that sent the call again while
    the first waited) both looked, found no entry and both wrote one — the journal told of
    two deliveries, and the count that keys the next identical call skipped one. The stream
    head's lock would come too late: it orders the appends, not the looks before them."""
    with transaction.atomic(durable=True):
        locked = Run.objects.select_for_update().filter(pk=call.run_id, tenant_id=call.tenant_id)
        locked.values_list("pk", flat=True).first()
        if (
            _delivered(call.run_id, call.tenant_id, call.call_hash)
            .filter(payload__action_id=str(action.action_id))
            .exists()
        ):
            return
        record(
            ledger.RunRef(action.run_id, action.tenant_id),
            RunEvent.RESULT_DELIVERED,
            caller.who,
            action_id=str(action.action_id),
            call=call.call_hash,
            outcome=action.status,
        )


# --- answers -----------------------------------------------------------------------------


# Every answer that is not the call's outcome starts with PENDING: and says so — the server's
# instructions tell the host that such an answer is not a result (a bare "in progress" reads
# as the tool's output to a model).
AGAIN = "Call it again with the same arguments to get its outcome."


@dataclass
class Answer:
    """What the client is told about its call now. `final`: the call's last word (its
    delivery is recorded); `waiting`: it may still change while the client waits."""

    text: str
    is_error: bool = False
    content: list[dict[str, Any]] = field(default_factory=list)
    structured: Any = None
    meta: dict[str, Any] = field(default_factory=dict)
    final: bool = False
    waiting: bool = False


def answer(action: Action | None) -> Answer:
    """The MCP answer for an action as it stands (None: the session is busy)."""
    if action is None:
        return Answer(
            "PENDING: not done yet. Another call of this session is being sent first. " + AGAIN,
            waiting=True,
        )
    meta = {
        "holdpoint/action_id": str(action.action_id),
        "holdpoint/status": action.status,
        "holdpoint/session": str(action.run_id),  # the Mcp-Session-Id, and the run's id
    }
    if action.status == S.CONFIRMED:
        # Only an upstream's answer is an MCP result (runtime.mcp): an http service's JSON may
        # have fields of these names (a note's own `content`) that are no MCP blocks.
        result = action.result if isinstance(action.result, dict) else {}
        if tool_of(action).executor != Sender.MCP:
            result = {}
        content = list(result.get("content") or [])
        structured = result.get("structuredContent")
        if not content:
            content = [{"type": "text", "text": json.dumps(structured or action.external_id)}]
        return Answer("", content=content, structured=structured, meta=meta, final=True)
    if action.status == S.AWAITING_APPROVAL:
        link = approval_link(action)
        meta["holdpoint/approval_url"] = link
        return Answer(
            f"PENDING: not done yet. {action.tool} waits for a reviewer's approval: {link} . "
            "Call it again with the same arguments to get the decided outcome.",
            meta=meta,
            waiting=True,
        )
    if action.status == S.MANUAL_REVIEW:
        link = settings.HOLDPOINT_BASE_URL + reverse("reconcile-detail", args=[action.pk])
        meta["holdpoint/reconcile_url"] = link
        return Answer(
            f"NEEDS A PERSON: Holdpoint cannot tell whether {action.tool} took effect (its "
            f"answer was lost and the tool cannot be asked again safely). A person must "
            f"settle it: {link} . Do not call it again with other arguments to work around "
            "this.",
            is_error=True,
            meta=meta,
        )
    if action.status == S.CANCELLED and action.last_error.startswith("rejected"):
        return Answer(f"REJECTED: {action.last_error}", is_error=True, meta=meta, final=True)
    if action.status in FINAL:
        detail = action.last_error or action.status
        return Answer(f"FAILED: {action.tool}: {detail}", is_error=True, meta=meta, final=True)
    if action.status == S.PREPARED and action.last_error:
        return Answer(
            f"NOT SENT: {action.tool} could not be reached ({action.last_error}); nothing "
            "was done. Call it again with the same arguments to retry.",
            is_error=True,
            meta=meta,
        )
    return Answer(
        f"PENDING: not done yet. {action.tool} is {action.status}. " + AGAIN,
        meta=meta,
        waiting=True,
    )


def approval_link(action: Action) -> str:
    """The page of the action's newest approval request (HOLDPOINT_BASE_URL + its path)."""
    request_id = (
        ApprovalRequest.objects.filter(tenant_id=action.tenant_id, action=action)
        .order_by("-created_at")
        .values_list("id", flat=True)
        .first()
    )
    if request_id is None:
        return settings.HOLDPOINT_BASE_URL + reverse("inbox")
    return settings.HOLDPOINT_BASE_URL + reverse("approval-page", args=[request_id])
