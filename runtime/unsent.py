"""A standalone action's sends that found their tool unreachable: noted on its row and
journalled (`note_unsent`), and rung again by the sweeper when their retry time comes
(`claim_resends`).

A compensation has no step driving it and no run parked on it, so nothing else would try it
again or tell a tenant admin it is stuck; a step's action instead waits in its step. Apart
from runtime.ledger, which holds the transitions these never make: each write here is a
compare-and-swap on the action still being unsent, and leaves its status alone.
"""

from __future__ import annotations

from django.db import transaction
from django.db.models.functions import Now

from fastsql import statements
from runtime.events import RunEvent, record
from runtime.leases import db_now_plus
from runtime.ledger import RunRef, absorb, reload
from runtime.models import SENDABLE, Action

# What the run page may show of why a send failed (the action's `send_failure` column).
SEND_FAILURE_MAX = 500


def note_unsent(action: Action, reason: str, actor: str, *, retry_in: float | None) -> Action:
    """A standalone action's send (a compensation's: no step drives it, so no run parks on
    it) met a tool it could not reach — nothing applied, and for a circuit open or an
    inactive MCP server nothing else was written: its row keeps when (database time), why,
    one more such failure, and when the sweeper tries again (`retry_in` seconds from now;
    None: it does not), journalled, so that it can be told from one still queued and a
    tenant admin can send it again. A compare-and-swap on its unsent status: one another
    ring sent meanwhile is left as it is (and returned as it is)."""
    reason = reason[:SEND_FAILURE_MAX]
    changes = {
        "send_failed_at": statements.NOW,
        "send_failure": reason,
        "send_failures": statements.Add(1),
        "send_retry_at": None if retry_in is None else statements.DbNow(retry_in),
    }
    where = {
        "action_id": action.pk,
        "tenant_id": statements.Check(action.tenant_id),
        "status": list(SENDABLE),
    }
    with transaction.atomic(durable=True):
        rows = statements.update(Action, changes, where, returning=statements.attnames(Action))
        if not rows:
            return reload(action)
        absorb(action, rows[0])
        record(
            RunRef(action.run_id, action.tenant_id),
            RunEvent.ACTION_SEND_FAILED,
            actor,
            action_id=str(action.action_id),
            idempotency_key=action.idempotency_key,
            tool=action.tool,
            reason=reason,
            send_failures=action.send_failures,
            retry_at=action.send_retry_at.isoformat() if action.send_retry_at else None,
        )
    return action


def claim_resends(limit: int, hold: float) -> list[tuple[str, int]]:
    """(action id, tenant) of up to `limit` unsent actions whose retry time came (database
    clock; set by `note_unsent`, and by `compensation.compensate` for a first ring that may
    be lost), each claimed by moving that time `hold` seconds on — a compare-and-swap on its
    being due — so that the next sweep does not ring it again while its ring waits in the
    queue. A ring that is lost is rung again after `hold`; the send's own failure sets the
    next time, a send takes it out of the sweeper's index."""
    due = (
        Action.objects.filter(status__in=SENDABLE, send_retry_at__lte=Now())
        .order_by("send_retry_at")
        .values_list("action_id", "tenant_id")[:limit]
    )
    claimed = []
    for action_id, tenant_id in list(due):
        moved = Action.objects.filter(
            pk=action_id, tenant_id=tenant_id, status__in=SENDABLE, send_retry_at__lte=Now()
        ).update(send_retry_at=db_now_plus(hold))
        if moved:
            claimed.append((str(action_id), tenant_id))
    return claimed
