"""What reviewers read: expiry in words, what happens at expiry, and how a decision went.

Display only. What expiry *does* is `approvals.expiry`'s (the policy's choice); these words
describe it, so a change there changes `then_phrase` here. The views and templates only
show these strings.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from approvals.expiry import final_expiry_needs_attention
from approvals.models import ApprovalRequest, ApprovalStatus, Decision, OnExpiry
from runtime.errors import AlreadyDecided, Expired, HashMismatch, HoldpointError, NotPermitted

A = ApprovalStatus
# What the expirer does at expiry, by policy (the default, re-request, depends on the count).
THEN: dict[str, str] = {  # keyed by OnExpiry; policies store its str value
    OnExpiry.REJECT: "then it is rejected automatically",
    OnExpiry.APPROVE: "then it is approved automatically (the policy says so explicitly)",
}


@dataclass(frozen=True)
class Expiry:
    """A countdown in words; `soon` (under an hour) and `overdue` pick its style."""

    text: str
    soon: bool
    overdue: bool


def duration(seconds: float) -> str:
    """'3 h 12 min', '2 d 4 h', '45 min', 'under a minute' — what a reviewer reads."""
    if seconds < 60:
        return "under a minute"
    minutes = int(seconds // 60)
    days, rest = divmod(minutes, 24 * 60)
    hours, mins = divmod(rest, 60)
    if days:
        return f"{days} d {hours} h" if hours else f"{days} d"
    if hours:
        return f"{hours} h {mins} min" if mins else f"{hours} h"
    return f"{mins} min"


def then_phrase(on_expiry: str, rerequest_count: int, graph: str, *, undo: bool = False) -> str:
    """What the expirer will do (approvals.expiry): the policy's choice, in words. `graph`:
    the run's graph as the request shows it (`graph_of`), since what the last expiry does to
    the run is the graph's — an MCP session's host is answered REJECTED and its run goes on;
    saying "the run needs attention" there would send a reviewer looking for nothing.
    `undo`: the request is a compensation's (`undoes`), whose last expiry rejects it and
    leaves its run alone — no step waits for it."""
    if on_expiry in THEN:
        return THEN[on_expiry]
    if undo:
        last = "rejected: the compensation is not sent"
        if rerequest_count < 1:
            return f"then re-requested once, then {last}"
        return f"then it is {last} (it was already re-requested once)"
    name, _, version = graph.rpartition("@")
    attention = final_expiry_needs_attention(name, version)
    if rerequest_count < 1:
        last = "the run needs attention" if attention else "rejected: the run goes on without it"
        return f"then re-requested once, then {last}"
    last = "the run needs attention" if attention else "the run goes on without it"
    return f"then it is rejected and {last} (it was already re-requested once)"


def undoes(found: ApprovalRequest) -> dict[str, str]:
    """A compensation's request: the action it undoes and who asked for the undo, frozen in
    `shown` at request time (`approvals.requests`); {} for a step's action."""
    compensates = (found.shown or {}).get("compensates")
    return compensates if isinstance(compensates, dict) else {}


def graph_of(found: ApprovalRequest) -> str:
    """The request's graph as "name@version": frozen in `shown` at request time (the inbox
    reads the same key as a column), else its run's."""
    shown = found.shown or {}
    return str(shown.get("graph") or f"{found.run.graph}@{found.run.graph_version}")


def expiry_of(
    expires_at: datetime,
    on_expiry: str,
    rerequest_count: int,
    now: datetime,
    *,
    graph: str,
    undo: bool = False,
) -> Expiry:
    then = then_phrase(on_expiry, rerequest_count, graph, undo=undo)
    left = (expires_at - now).total_seconds()
    if left <= 0:
        return Expiry(f"expired {duration(-left)} ago — {then} at the next sweep", True, True)
    return Expiry(f"expires in {duration(left)} — {then}", left < 3600, False)


def refusal_text(exc: HoldpointError, found: ApprovalRequest) -> str:
    """What a reviewer is told when `decide` refused; nothing was recorded in every case."""
    if isinstance(exc, HashMismatch):
        return (
            "This request changed since you opened it — here is the current version. "
            f"Nothing was recorded; check it again before you decide ({exc.detail})."
        )
    if isinstance(exc, AlreadyDecided):
        return f"Nothing was recorded: {exc.detail}."
    if isinstance(exc, Expired):
        then = then_phrase(
            found.policy.on_expiry,
            found.rerequest_count,
            graph_of(found),
            undo=bool(undoes(found)),
        )
        return f"Nothing was recorded: this request {exc.detail} — {then}."
    if isinstance(exc, NotPermitted):
        return f"Not permitted: {exc.detail}. Nothing was recorded."
    return exc.detail


def done_text(found: ApprovalRequest, decision: str, edits: dict[str, Any] | None) -> str:
    """What a reviewer is told after `decide` applied their decision (or their vote)."""
    if found.status == A.PENDING:
        given = found.votes.filter(decision=Decision.APPROVE).count()
        return f"Your approval is recorded ({given} of {found.quorum} needed): {found.title}."
    undo = undoes(found)
    if decision == Decision.REJECT and undo:
        return (
            f"Rejected: {found.title}. The compensation is not sent; "
            f"{undo.get('tool')} {undo.get('idempotency_key')} stays confirmed."
        )
    if decision == Decision.REJECT:
        return f"Rejected: {found.title}. The run goes on without it."
    if edits:
        edited = f"Approved with your edits ({', '.join(sorted(edits))}): {found.title}."
        return f"{edited} The compensation is queued to send." if undo else edited
    then = "The compensation is queued to send." if undo else "The run is queued to send it."
    return f"Approved: {found.title}. {then}"
