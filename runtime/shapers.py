"""Recording who shaped a run (the table is `runtime.models.RunShaper`, which says why).

One writer, called inside the transaction of each act that shapes what a run does next:
starting it, revising its goal, giving it input. Approvals read the rows to keep whoever
shaped an action from approving it.
"""

from __future__ import annotations

from datetime import datetime

from django.db.models.functions import Now

from fastsql.statements import tenant_check
from runtime.models import Run
from runtime.models.shapers import RunShaper, ShaperKind


def record_shaper(run: Run, actor: str, kind: ShaperKind, goal_rev: int) -> None:
    """`actor` shaped `run` (inside the caller's transaction, beside its journal entry)."""
    RunShaper.objects.create(
        tenant_id=run.tenant_id,
        run_id=run.pk,
        actor=actor[:200],
        kind=kind,
        goal_rev=goal_rev,
        created_at=Now(),
    )


def shapers_of(
    run: Run, goal_rev: int, since: datetime | None, *, until: datetime | None = None
) -> set[str]:
    """The actors who shaped an action of `run` prepared under `goal_rev`: whoever started
    the run, whoever wrote that goal revision, and whoever revised the goal or gave input
    since `since` (the run's last decision; None: since the start). `until`: as they stood
    then (a decision's time: who shaped the run only after it did not shape what it
    decided)."""
    rows = RunShaper.objects.filter(tenant_check(run.tenant_id), run_id=run.pk)
    if until is not None:
        rows = rows.filter(created_at__lte=until)
    actors = set()
    for actor, kind, rev, at in rows.values_list("actor", "kind", "goal_rev", "created_at"):
        if (
            kind == ShaperKind.STARTED
            or (kind == ShaperKind.REVISED and rev == goal_rev)
            or since is None
            or at >= since
        ):
            actors.add(actor)
    return actors
