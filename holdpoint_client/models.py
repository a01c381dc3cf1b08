"""Typed results of the Holdpoint API (API.md), as frozen dataclasses.

API.md fixes names and status words but lets the server add fields, so every object keeps
the whole JSON it came from in `raw`: a newer server's extra fields are one lookup away and
never break parsing. Statuses stay plain strings for the same reason; the constants below
name the ones API.md fixes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, TypeVar
from urllib.parse import parse_qs, urlsplit

T = TypeVar("T")

RUN_STATUSES = (
    "queued",
    "running",
    "waiting_input",
    "waiting_approval",
    "retrying",
    "needs_reconciliation",
    "needs_attention",
    "completed",
    "failed",
    "cancelled",
)
RUN_TERMINAL = frozenset({"completed", "failed", "cancelled"})
ACTION_STATUSES = (
    "prepared",
    "awaiting_approval",
    "approved",
    "sent",
    "confirmed",
    "unknown",
    "failed",
    "manual_review",
    "cancelled",
    "compensated",
)
APPROVAL_STATUSES = ("pending", "approved", "rejected", "expired", "superseded", "cancelled")


def parse_time(value: Any) -> datetime | None:
    """ISO 8601 from the API (a trailing Z included) to an aware datetime; None stays None."""
    if value in (None, ""):
        return None
    return datetime.fromisoformat(str(value).replace("Z", "+00:00"))


def cursor_of(url: Any) -> str | None:
    """The `cursor` parameter of a `next`/`previous` link. The link's host is the one the
    server saw (a proxy may rewrite it), so the client keeps only the cursor and calls its
    own base URL again."""
    if not url:
        return None
    values = parse_qs(urlsplit(str(url)).query).get("cursor")
    return values[0] if values else None


def _str_or_none(value: Any) -> str | None:
    return None if value is None else str(value)


@dataclass(frozen=True)
class Lease:
    owner: str
    expires_at: datetime | None
    fence: int

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Lease:
        return cls(
            owner=str(data.get("owner") or ""),
            expires_at=parse_time(data.get("expires_at")),
            fence=int(data.get("fence") or 0),
        )


@dataclass(frozen=True)
class Run:
    run_id: str
    thread_id: str
    graph: str
    graph_version: str
    status: str
    goal: Any
    goal_rev: int
    checkpoint_rev: int
    next_step: str
    waiting_for: Any
    lease: Lease
    created_at: datetime | None
    updated_at: datetime | None
    raw: dict[str, Any] = field(repr=False, compare=False)
    # The data given with `provide_input` that the run has not taken yet (None: none). An
    # external executor reads it here after leasing the run again; its next checkpoint
    # takes it, as a hosted step's commit takes `ctx.input`.
    input: Any = None

    @property
    def finished(self) -> bool:
        return self.status in RUN_TERMINAL

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Run:
        return cls(
            run_id=str(data["run_id"]),
            thread_id=str(data.get("thread_id") or ""),
            graph=str(data.get("graph") or ""),
            graph_version=str(data.get("graph_version") or ""),
            status=str(data["status"]),
            goal=data.get("goal"),
            goal_rev=int(data.get("goal_rev") or 0),
            checkpoint_rev=int(data.get("checkpoint_rev") or 0),
            next_step=str(data.get("next_step") or ""),
            waiting_for=data.get("waiting_for"),
            lease=Lease.from_json(data.get("lease") or {}),
            created_at=parse_time(data.get("created_at")),
            updated_at=parse_time(data.get("updated_at")),
            raw=dict(data),
            input=data.get("input"),
        )


@dataclass(frozen=True)
class Checkpoint:
    rev: int
    goal_rev: int
    next_step: str
    status: str
    state: Any
    digest: str
    created_at: datetime | None
    created_by: str
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Checkpoint:
        return cls(
            rev=int(data["rev"]),
            goal_rev=int(data.get("goal_rev") or 0),
            next_step=str(data.get("next_step") or ""),
            status=str(data.get("status") or ""),
            state=data.get("state"),
            digest=str(data.get("digest") or ""),
            created_at=parse_time(data.get("created_at")),
            created_by=str(data.get("created_by") or ""),
            raw=dict(data),
        )


@dataclass(frozen=True)
class Action:
    action_id: str
    run_id: str
    idempotency_key: str
    tool: str
    params: dict[str, Any]
    fingerprint: str
    status: str
    goal_rev: int
    external_id: str
    result: Any
    approval: str | None
    attempts: int
    last_error: str
    created_at: datetime | None
    updated_at: datetime | None
    raw: dict[str, Any] = field(repr=False, compare=False)
    # What the server says happens next to an action nobody has proven (sent, unknown,
    # manual_review): "replay_same_key", "lookup" or "manual_review"; "" otherwise.
    reconcile: str = ""
    # With reconcile "lookup": the server accepts "not_found" only after this time.
    not_found_after: datetime | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Action:
        reconcile = data.get("reconcile") or {}
        return cls(
            action_id=str(data["action_id"]),
            run_id=str(data.get("run_id") or ""),
            idempotency_key=str(data.get("idempotency_key") or ""),
            tool=str(data.get("tool") or ""),
            params=dict(data.get("params") or {}),
            fingerprint=str(data.get("fingerprint") or ""),
            status=str(data["status"]),
            goal_rev=int(data.get("goal_rev") or 0),
            external_id=str(data.get("external_id") or ""),
            result=data.get("result"),
            approval=_str_or_none(data.get("approval")),
            attempts=int(data.get("attempts") or 0),
            last_error=str(data.get("last_error") or ""),
            created_at=parse_time(data.get("created_at")),
            updated_at=parse_time(data.get("updated_at")),
            raw=dict(data),
            reconcile=str(reconcile.get("how") or ""),
            not_found_after=parse_time(reconcile.get("not_found_after")),
        )


@dataclass(frozen=True)
class ApprovalAction:
    """What the reviewer is shown of the action the approval binds."""

    action_id: str
    tool: str
    params: dict[str, Any]
    target: str
    reason: str
    impact: str
    editable: tuple[str, ...]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ApprovalAction:
        return cls(
            action_id=str(data.get("action_id") or ""),
            tool=str(data.get("tool") or ""),
            params=dict(data.get("params") or {}),
            target=str(data.get("target") or ""),
            reason=str(data.get("reason") or ""),
            impact=str(data.get("impact") or ""),
            editable=tuple(str(name) for name in data.get("editable") or ()),
        )


@dataclass(frozen=True)
class Approval:
    id: str
    run_id: str
    title: str
    action: ApprovalAction
    action_hash: str
    status: str
    expires_at: datetime | None
    decided_by: str | None
    decided_at: datetime | None
    decision: str
    decision_reason: str
    # Why it ended other than by its decision (expired, superseded at the send's re-check:
    # "expired at … before it was sent; re-requested"), in the words reviewers read.
    closed_reason: str
    raw: dict[str, Any] = field(repr=False, compare=False)

    @property
    def pending(self) -> bool:
        return self.status == "pending"

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Approval:
        return cls(
            id=str(data["id"]),
            run_id=str(data.get("run_id") or ""),
            title=str(data.get("title") or ""),
            action=ApprovalAction.from_json(data.get("action") or {}),
            action_hash=str(data.get("action_hash") or ""),
            status=str(data["status"]),
            expires_at=parse_time(data.get("expires_at")),
            decided_by=_str_or_none(data.get("decided_by")),
            decided_at=parse_time(data.get("decided_at")),
            decision=str(data.get("decision") or ""),
            decision_reason=str(data.get("decision_reason") or ""),
            closed_reason=str(data.get("closed_reason") or ""),
            raw=dict(data),
        )


@dataclass(frozen=True)
class JournalEntry:
    seq: int
    type: str
    actor: str
    payload: Any
    prev_hash: str
    hash: str
    created_at: datetime | None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JournalEntry:
        return cls(
            seq=int(data["seq"]),
            type=str(data["type"]),
            actor=str(data.get("actor") or ""),
            payload=data.get("payload"),
            prev_hash=str(data.get("prev_hash") or ""),
            hash=str(data.get("hash") or ""),
            created_at=parse_time(data.get("created_at")),
        )


@dataclass(frozen=True)
class LeaseGrant:
    """A lease just taken: every executor write from now on carries this `fence`."""

    fence: int
    expires_at: datetime | None
    owner: str

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LeaseGrant:
        return cls(
            fence=int(data["fence"]),
            expires_at=parse_time(data.get("expires_at")),
            owner=str(data.get("owner") or ""),
        )


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a cursor-paginated list; `next_cursor` feeds the next call."""

    results: list[T]
    next_cursor: str | None
    previous_cursor: str | None

    @classmethod
    def from_json(cls, data: Mapping[str, Any], parse: Callable[[Mapping[str, Any]], T]) -> Page[T]:
        return cls(
            results=[parse(item) for item in data.get("results") or []],
            next_cursor=cursor_of(data.get("next")),
            previous_cursor=cursor_of(data.get("previous")),
        )
