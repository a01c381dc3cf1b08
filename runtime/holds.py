"""Whether a run waits for a reviewer: the one writer of a hold's start and end on the run.

A run waits in `waiting_approval` as long as any action a step of it drives (not a standalone
compensation: no step waits for one) is `awaiting_approval`, and its `waiting_for` names the
oldest of them. An external executor — an agent's own loop, a LangGraph batch, an MCP
session — may prepare several gated actions before any is decided: deciding one (approve,
reject, its expiry) or a person settling another must not wake the run while another still
waits for its reviewer, or the Runs pages, the metrics and the executor reading the run see
nothing waiting where a reviewer still must act. Every writer here runs inside its caller's
transaction, the run's row locked first and its actions read after (the lock order of every
writer of a run's actions; the purge relies on it).
"""

from __future__ import annotations

from typing import Any

from django.db.models import OuterRef, QuerySet, Subquery
from django.db.models.functions import Now

from fastsql.statements import tenant_check
from runtime.events import RunEvent, record
from runtime.models import STANDALONE, Action, ActionStatus, Run, RunStatus
from runtime.queue import ring

S = ActionStatus
WAITING = RunStatus.WAITING_APPROVAL
# The statuses of a leased external run that a held action parks in `waiting_approval`: the
# executor is at it — running, or `queued` again while it keeps its lease (a goal revision,
# a decision or a resolve woke it). A run that waits for input or for a person stays as it is.
PARKABLE = (RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.RETRYING)
# What a dispatch finds a run in that it parks again for another held action (`align`).
REPARKABLE = (*PARKABLE, WAITING)


def held(tenant_id: int, run_id: Any) -> QuerySet[Action]:
    """The run's actions a reviewer must still decide before a step goes on, oldest first."""
    return (
        Action.objects.filter(tenant_id=tenant_id, run_id=run_id, status=S.AWAITING_APPROVAL)
        .exclude(step=STANDALONE)
        .order_by("created_at", "action_id")
    )


def for_review(tenant_id: int, run_id: Any) -> QuerySet[Action]:
    """The run's actions only a person can settle that hold the run (`manual_review`),
    oldest first. An undo (a compensation) in `manual_review` is a person's too, but it
    holds no run: no step drives it and no run waits for it (runtime.compensation)."""
    return (
        Action.objects.filter(tenant_id=tenant_id, run_id=run_id, status=S.MANUAL_REVIEW)
        .exclude(step=STANDALONE)
        .order_by("created_at", "action_id")
    )


def holds_its_run(action: Action) -> bool:
    """Whether `action`, as it is now, keeps its run waiting for a person (`for_review`)."""
    return action.status == S.MANUAL_REVIEW and not action.standalone


def waiting_for(action: Action) -> dict[str, Any]:
    """The run's `waiting_for` while `action` waits for its reviewer."""
    return {"kind": "approval", "action_id": str(action.action_id), "tool": action.tool}


def reconciliation_for(action: Action) -> dict[str, Any]:
    """The run's `waiting_for` while `action` waits for a person to settle it."""
    return {"kind": "reconciliation", "action_id": str(action.action_id), "tool": action.tool}


def park(
    run: Run, fence: int, action: Action, actor: str, statuses: tuple[str, ...] = PARKABLE
) -> None:
    """A run whose executor is at it (PARKABLE) and whose action waits for a reviewer waits
    with it (inside the prepare), as a worker's run parks: `waiting_approval`, `waiting_for`
    naming the action. `statuses`: the ones it may be parked from (a dispatch's `align`
    parks it again, for another action)."""
    parked = Run.objects.filter(
        pk=run.run_id, tenant_id=run.tenant_id, fence=fence, status__in=statuses
    ).update(status=WAITING, waiting_for=waiting_for(action), updated_at=Now())
    if parked:
        record(run, RunEvent.PARKED, actor, reason=f"{action.tool} needs approval", status=WAITING)


def align(action: Action, fence: int, actor: str) -> None:
    """Inside the dispatch: the run this fence holds, parked for an approval (or woken by
    it), is running again — with its journal entry — unless another of its actions still
    waits for a reviewer: then it waits for that one (the oldest), as a prepare parks it.
    Sending one action says nothing of the others: an MCP session's call, sent while an
    earlier one waited for a reviewer, made the session `running` (`queued` at the lease's
    release), `waiting_for` gone, while that call still waited."""
    run = Run(run_id=action.run_id, tenant_id=action.tenant_id)
    mine = Run.objects.filter(pk=action.run_id, tenant_id=action.tenant_id, fence=fence)
    first = held(action.tenant_id, OuterRef("pk")).values("action_id")[:1]
    found = (
        mine.filter(status__in=REPARKABLE)
        .annotate(held=Subquery(first))
        .values_list("status", "waiting_for", "held")
        .first()
    )
    if found is None:
        return
    previous, waits, oldest = found
    if oldest is not None:
        if (previous, (waits or {}).get("action_id")) != (WAITING, str(oldest)):
            park(run, fence, Action.objects.get(pk=oldest), actor, REPARKABLE)
        return
    if previous not in (WAITING, RunStatus.QUEUED):
        return
    mine.filter(status=previous).update(
        status=RunStatus.RUNNING, waiting_for=None, updated_at=Now()
    )
    record(run, RunEvent.RESUMED, actor, previous_status=previous, status=RunStatus.RUNNING)


def wake(run: Run, actor: str, reason: str = "approval decided", *, waiting: str = WAITING) -> bool:
    """A wait ended — a reviewer's decision, an approval's expiry, a person settling an
    action (`waiting`: `needs_reconciliation`) — and the run waiting in `waiting` goes on:
    `queued`, its workers rung after commit. Unless another of its actions still waits for
    a reviewer: then it waits in `waiting_approval` for the oldest of them, woken only by
    the decision of the last. Whether it was woken.

    Called by the decision and, after parking, by a worker itself: whichever commits second
    sees the other's change, so a decision made while the run was still parking can never
    leave it waiting for ever."""
    mine = Run.objects.filter(tenant_check(run.tenant_id), pk=run.pk, status=waiting)
    before = mine.select_for_update().values_list("status", "waiting_for").first()
    if before is None:
        return False
    waits = before[1]
    oldest = held(run.tenant_id, run.pk).only("action_id", "tool").first()
    if oldest is not None:
        still = waiting_for(oldest)
        if (waiting, (waits or {}).get("action_id")) != (WAITING, still["action_id"]):
            mine.update(status=WAITING, waiting_for=still, updated_at=Now())
            why = f"{oldest.tool} still needs approval"
            record(run, RunEvent.PARKED, actor, reason=why, status=WAITING)
        return False
    mine.update(status=RunStatus.QUEUED, waiting_for=None, updated_at=Now())
    if waiting == WAITING:
        record(run, RunEvent.WOKEN, actor, reason=reason, status=RunStatus.QUEUED)
    else:
        record(run, RunEvent.RESUMED, actor, previous_status=waiting, status=RunStatus.QUEUED)
    ring(run.pk)
    return True


def person_wait(run: Run) -> tuple[str, dict[str, Any]] | None:
    """What the run waits for that only a person can end, as (status, waiting_for), for an
    executor's `running` checkpoint to keep — it says the executor is at it again, which ends
    a wait for its input but not these: an action in `manual_review` (`needs_reconciliation`,
    its current `waiting_for` kept while the action it names still waits), else a held one
    (`waiting_approval`, the oldest). None: nothing such."""
    pending = list(
        Action.objects.filter(
            tenant_id=run.tenant_id,
            run_id=run.run_id,
            status__in=(S.MANUAL_REVIEW, S.AWAITING_APPROVAL),
        )
        .exclude(step=STANDALONE)  # (for_review, held)
        .only("action_id", "tool", "status")
        .order_by("created_at", "action_id")
    )
    for_person = [a for a in pending if a.status == S.MANUAL_REVIEW]
    if for_person:
        waits = run.waiting_for or {}
        named = {str(a.action_id) for a in for_person}
        if waits.get("kind") == "reconciliation" and waits.get("action_id") in named:
            return RunStatus.NEEDS_RECONCILIATION, waits
        return RunStatus.NEEDS_RECONCILIATION, reconciliation_for(for_person[0])
    if pending:
        return WAITING, waiting_for(pending[0])
    return None
