"""Retention: removing old run data while every journal chain still verifies.

Runs past their tenant's retention lose their checkpoints, recorded calls, actions,
approvals and unreferenced artifacts; their journal entries stay, with payloads replaced by
digests (the chain hashes cover digests, so it verifies as before). Never purged: a run that
is not finished, has an open approval, an action whose outcome is not settled, or a
compensation not sent yet. Kept
and named (`PurgeReport.held`), the rest purged: a due run with a journal entry that cannot
be redacted — edited into a payload no writer stores — so its evidence stays for
audit_verify, and one such run does not stop the purge of the others, or of other tenants.
Approvals are the hold points' business: `gates.purgeable` leaves out the runs they still
need, and their rows cascade from the run's.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Exists, OuterRef, QuerySet

from audit import journal
from audit.models import JournalEntry, PurgeGate
from runtime import gates, metrics
from runtime.artifacts import collect_refs
from runtime.leases import db_now
from runtime.models import (
    STANDALONE,
    TERMINAL,
    UNSENT,
    Action,
    ActionStatus,
    Artifact,
    Checkpoint,
    Run,
    Tenant,
)

log = logging.getLogger("holdpoint.retention")
KEEP_ACTIONS = (ActionStatus.SENT, ActionStatus.UNKNOWN, ActionStatus.MANUAL_REVIEW)


@dataclass
class PurgeReport:
    tenant: str
    runs: list[str] = field(default_factory=list)
    checkpoints: int = 0
    artifacts: int = 0
    entries_redacted: int = 0
    # Runs kept although due: their journal cannot be redacted (an entry was edited into
    # something no writer stores). run id → why; audit_verify names the entry too.
    held: dict[str, str] = field(default_factory=dict)


def purgeable(runs: QuerySet[Run]) -> QuerySet[Run]:
    """Finished runs with nothing open: no pending approval, no unsettled action, no
    compensation still to be sent.

    A compensation (a standalone action) follows a finished run and does not touch it, so
    its run can be due while a person's undo waits for its sender, a decision, or the
    sweeper's next try: purged with the run, the undo was gone and the effect stayed."""
    open_actions = Action.objects.filter(status__in=KEEP_ACTIONS).values("run_id")
    # Per run, by the action table's run index: no index holds unsent compensations, and a
    # list of them all would read every action of every tenant at each batch.
    undo = Action.objects.filter(run_id=OuterRef("pk"), step=STANDALONE, status__in=UNSENT)
    runs = runs.filter(status__in=TERMINAL).exclude(run_id__in=open_actions).exclude(Exists(undo))
    return gates.purgeable(runs)  # hold points keep a run with an open request


def due_runs(tenant: Tenant, now: datetime) -> QuerySet[Run]:
    try:
        cutoff = now - timedelta(days=tenant.retention_days)
    except OverflowError:  # kept for longer than the calendar goes back: nothing is due
        return Run.objects.none()
    return purgeable(Run.objects.filter(tenant=tenant, updated_at__lt=cutoff))


def purge_tenant(
    tenant: Tenant,
    *,
    now: datetime | None = None,
    dry_run: bool = False,
    thread_id: str | None = None,
    actor: str = "system:retention",
    batch_size: int | None = None,
) -> PurgeReport:
    """Purge a tenant's expired runs (or, with `thread_id`, that thread's finished runs), in
    batches of `batch_size` runs (HOLDPOINT_PURGE_BATCH), each its own transaction: one
    batch's locks — its runs, and the artifact table while its orphans go (see
    `_hold_artifact_writes`) — are let go before the next, so step commits go on between
    batches however much is due. Each batch is journalled as one `retention_purged`.

    "Expired" is by the database's clock, which stamps a run's updated_at at every change
    of its status: by this process's, a purger whose clock ran ahead purged runs before
    their retention was up (and one behind kept them past it)."""
    now = now or db_now()
    runs = (
        purgeable(Run.objects.filter(tenant=tenant, thread_id=thread_id))
        if thread_id
        else due_runs(tenant, now)
    )
    if dry_run:
        return _preview(tenant, runs)
    report = PurgeReport(tenant.slug)
    size = batch_size or settings.HOLDPOINT_PURGE_BATCH
    kept = _Kept(tenant.pk)
    while True:
        # Each batch purges or holds every run it lists, or finds it gone (taken by a purge
        # beside this one): the next listing has none of them, and the loop ends.
        waiting = runs.exclude(run_id__in=list(report.held))
        batch = [str(r) for r in waiting.values_list("run_id", flat=True)[:size]]
        if not batch:
            return report
        _purge_batch(tenant, runs, batch, report, kept, thread_id=thread_id, actor=actor)


def _purge_batch(
    tenant: Tenant,
    runs: QuerySet[Run],
    batch: list[str],
    report: PurgeReport,
    kept: _Kept,
    *,
    thread_id: str | None,
    actor: str,
) -> None:
    """One batch's purge, in its own transaction; adds what it did to `report`."""
    with transaction.atomic(durable=True):
        purged = _still_due(tenant, runs, batch)
        if not purged:
            return
        gate = PurgeGate.objects.create(reason=f"retention purge of {tenant.slug}")
        streams = {journal.run_stream(run_id): run_id for run_id in purged}
        takeovers = metrics.takeovers_in(streams)
        redaction = JournalEntry.objects.filter(stream__in=streams).redact()
        metrics.keep_redacted_takeovers(takeovers, redaction.refused)
        held = {streams[name]: why for name, why in redaction.refused.items()}
        purged = [run_id for run_id in purged if run_id not in held]
        if held:
            log.error("retention purge of %s kept runs it cannot redact: %s", tenant.slug, held)
        checkpoints = artifacts = 0
        if purged:
            doomed_checkpoints = Checkpoint.objects.filter(run_id__in=purged)
            doomed_refs = _refs(tenant.pk, doomed_checkpoints)
            kept.forget(doomed_refs)
            checkpoints = doomed_checkpoints.count()
            Run.objects.filter(run_id__in=purged).delete()  # cascades to the run's rows
            artifacts = _delete_orphans(tenant, doomed_refs, kept)
            journal.append(
                journal.tenant_stream(tenant.pk),
                "retention_purged",
                tenant_id=tenant.pk,
                actor=actor,
                payload={
                    "runs": purged,
                    "thread_id": thread_id,
                    "checkpoints": checkpoints,
                    "artifacts": artifacts,
                    "entries_redacted": redaction.done,
                    "held": held,
                    "retention_days": tenant.retention_days,
                },
            )
        gate.delete()
    report.runs += purged
    report.checkpoints += checkpoints
    report.artifacts += artifacts
    report.entries_redacted += redaction.done
    report.held.update(held)


def _still_due(tenant: Tenant, runs: QuerySet[Run], batch: list[str]) -> list[str]:
    """The batch's runs, locked, that still qualify now that they are: each run first, then
    its actions and the rest — the lock order of every writer of a run and its actions
    (`compensation.compensate` above all, whose undo is an action of a finished run).

    Locked in primary-key order, whatever plan the database picks: two purges of one tenant
    (different batch sizes, a thread's deletion request) then take the rows they share in
    the same order and one waits for the other, never each for the other (a deadlock). The
    model's default ordering (-created_at) is not a total order — runs created in the same
    microsecond tie — and is not this code's to rely on.

    Then read again, as a statement of its own: under READ COMMITTED a locking read that
    waited for a writer answers from the snapshot it began with, so a compensation committed
    while the purge waited for the run was not seen — the run was purged, and the undo a
    person had just asked for deleted with it. A read begun after the locks are held sees
    every commit before them; and whoever can make a finished run stay (asking for a
    compensation, raising or deciding its hold point) locks the run first, so nobody can
    until the batch ends. A run another purge took meanwhile is simply gone. (SQLite: the
    batch's IMMEDIATE transaction holds the one write lock from its start.)"""
    locked = Run.objects.filter(tenant=tenant, run_id__in=batch).order_by("pk")
    held = list(locked.select_for_update().values_list("run_id", flat=True))
    due = runs.filter(run_id__in=held).order_by("pk").values_list("run_id", flat=True)
    return [str(r) for r in due]


def _delete_orphans(tenant: Tenant, doomed_refs: set[str], kept: _Kept) -> int:
    """Delete the artifacts among `doomed_refs` that no kept checkpoint reaches."""
    if not doomed_refs:
        return 0  # nothing can be orphaned: no lock, no reading of the kept references
    _hold_artifact_writes()
    kept_refs = kept.reach()  # after the lock: see _hold_artifact_writes
    orphans = Artifact.objects.filter(tenant=tenant, digest__in=doomed_refs - kept_refs)
    count = orphans.count()
    orphans.delete()
    return count


def _preview(tenant: Tenant, runs: QuerySet[Run]) -> PurgeReport:
    """A dry run's report, as the purge would make it, writing nothing: the runs it would
    purge with their checkpoints, orphaned artifacts and redacted payloads (a dry run that
    said "0 checkpoint(s), 0 artifact(s)" for runs with hundreds was read as "cheap"), and
    the due runs it would keep because their journal cannot be redacted (counted among the
    purged before, while the purge then kept them and failed). Runs are matched by subquery,
    not by a list of ids, so a tenant with more due runs than the driver takes parameters
    is counted too."""
    due = [str(r) for r in runs.values_list("run_id", flat=True)]
    if not due:
        return PurgeReport(tenant.slug)
    streams = {journal.run_stream(run_id): run_id for run_id in due}
    redaction = JournalEntry.objects.filter(stream__in=streams).redaction_preview()
    held = {streams[name]: why for name, why in redaction.refused.items()}
    report = PurgeReport(tenant.slug, [r for r in due if r not in held], held=held)
    going = runs.exclude(run_id__in=list(held)).values("run_id")
    doomed = Checkpoint.objects.filter(run_id__in=going)
    kept = Checkpoint.objects.filter(run__tenant=tenant).exclude(run_id__in=going)
    orphans = _refs(tenant.pk, doomed) - _refs(tenant.pk, kept)
    report.checkpoints = doomed.count()
    report.artifacts = Artifact.objects.filter(tenant=tenant, digest__in=orphans).count()
    report.entries_redacted = redaction.done
    return report


def _hold_artifact_writes() -> None:
    """Until the purge's batch commits, no step commit may store an artifact (PostgreSQL).

    A step commit refers to an artifact that is already stored without writing it again
    (`ON CONFLICT DO NOTHING` takes no lock on the row it finds). Had it done so between
    the purge's reading of the kept references and its delete, the purge would delete an
    artifact its new checkpoint needs, and the run could never be read back or resumed.
    Every step commit that refers to an artifact it did not load from its own run's
    checkpoints (those are kept) inserts it, and an insert takes ROW EXCLUSIVE on the
    table, which this SHARE ROW EXCLUSIVE lock conflicts with: a commit under way is waited
    for (the kept references, read after, see its checkpoint), a later one waits for the
    purge (its insert then finds the row deleted and stores it again). `_Kept.reach` keeps
    that true while reading each checkpoint once a purge: it lists the kept checkpoints
    after the lock and answers with their references and no others — each counted in an
    earlier batch (a checkpoint's state never changes) or read now. Reads go on; so does
    every commit that stores nothing, and the step commit gains no statement. The lock is
    also self-exclusive, so two purges take their turns here. Only a batch with artifacts to
    delete takes it, and lets it go when it commits. SQLite needs nothing: the batch's
    transaction (IMMEDIATE) holds the one write lock from its start.
    """
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        table = connection.ops.quote_name(Artifact._meta.db_table)
        cursor.execute(f"LOCK TABLE {table} IN SHARE ROW EXCLUSIVE MODE")


class Reach(set[str]):
    """Every artifact digest some checkpoints reach (the set itself), and what was read on
    the way: which checkpoints, how many of them name each digest in their state, and what
    each artifact read names — so a purge can go on counting them without reading them again
    (`_Kept`)."""

    def __init__(self) -> None:
        super().__init__()
        self.checkpoints: set[int] = set()
        self.named: Counter[str] = Counter()
        self.children: dict[str, frozenset[str]] = {}


def _refs(tenant_id: int, checkpoints: QuerySet[Checkpoint]) -> Reach:
    """Every artifact digest the checkpoints reach, through nested artifacts too."""
    found = Reach()
    for pk, state in checkpoints.values_list("pk", "state").iterator():
        found.checkpoints.add(pk)
        found.named.update(collect_refs(state, set()))
    found |= _reach(tenant_id, set(found.named), found.children)
    return found


def _reach(tenant_id: int, roots: set[str], children: dict[str, frozenset[str]]) -> set[str]:
    """`roots` and every digest their artifacts name, through nested artifacts too. What an
    artifact names is read once into `children`: it never changes (the digest is its
    content's). A digest with no artifact (yet) names nothing."""
    reached, frontier = set(roots), set(roots)
    while frontier:
        unread = Artifact.objects.filter(tenant_id=tenant_id, digest__in=frontier - children.keys())
        for digest, content in unread.values_list("digest", "content"):
            children[digest] = frozenset(collect_refs(json.loads(content), set()))
        found: set[str] = set()
        for digest in frontier:
            found |= children.get(digest, frozenset())
        frontier = found - reached
        reached |= found
    return reached


def _chunks(ids: set[int], size: int = 2000) -> Iterator[list[int]]:
    """`ids` a few thousand at a time: checkpoints written between two batches can be many,
    and one IN list of them all could overrun a statement's parameters (SQLite's limit is
    32,766 in its default build)."""
    ordered = sorted(ids)
    for start in range(0, len(ordered), size):
        yield ordered[start : start + size]


class _Kept:
    """What the tenant's kept checkpoints reach, for each batch of one purge.

    A batch must delete only the artifacts no kept checkpoint reaches, so each read every
    kept checkpoint's state (and the artifacts they name): a purge of many batches read
    them all once per batch. Here each is read once per purge: checkpoints are append-only
    (a state never changes) and so is what an artifact names, so a count taken in an earlier
    batch is still true of every checkpoint still there. Which are still there is listed
    again at each batch, after the artifact lock (ids only): the counted ones, less the
    batch's own (`forget`), plus any not counted yet (read now) — the same set, and so the
    same references, as reading them all again. A counted checkpoint gone otherwise (a
    purge beside this one) has its references counted nowhere: they are all read again.
    """

    def __init__(self, tenant_id: int) -> None:
        self.tenant_id = tenant_id
        self.stale = True  # nothing counted yet, or the counts are not to be trusted
        self.counted: set[int] = set()  # the checkpoints whose references are counted
        self.named: Counter[str] = Counter()  # digest -> counted checkpoints naming it
        self.children: dict[str, frozenset[str]] = {}

    def forget(self, doomed: Reach) -> None:
        """The batch's checkpoints go: what they name keeps nothing any more."""
        self.children.update(doomed.children)
        if self.stale or not doomed.checkpoints & self.counted:
            return
        if doomed.checkpoints <= self.counted:
            self.counted -= doomed.checkpoints
            self.named -= doomed.named
        else:  # some counted, some not (written since): count again rather than guess
            self.stale = True

    def reach(self) -> set[str]:
        """Every digest a kept checkpoint reaches (call it after the artifact lock)."""
        # Through the tenant's runs: a checkpoint's tenant column has no index (runtime
        # migration 0035), its run's (run, rev) index serves the join.
        kept = Checkpoint.objects.filter(run__tenant_id=self.tenant_id)
        if not self.stale:
            listed = set(kept.values_list("pk", flat=True))
            if self.counted <= listed:
                for chunk in _chunks(listed - self.counted):
                    self._count(_refs(self.tenant_id, kept.filter(pk__in=chunk)))
                return _reach(self.tenant_id, set(self.named), self.children)
        self.counted, self.named, self.stale = set(), Counter(), False
        found = _refs(self.tenant_id, kept)
        self._count(found)
        return found

    def _count(self, found: Reach) -> None:
        self.counted |= found.checkpoints
        self.named += found.named
        self.children.update(found.children)


def purge(
    *,
    dry_run: bool = False,
    tenant_slug: str | None = None,
    thread_id: str | None = None,
    now: datetime | None = None,
    batch_size: int | None = None,
) -> list[PurgeReport]:
    """Every tenant's purge (or one tenant's); raises Tenant.DoesNotExist for a slug that
    names none, so a mistyped one is not taken for a tenant with nothing to purge."""
    tenants = Tenant.objects.all()
    if tenant_slug:
        tenants = tenants.filter(slug=tenant_slug)
        if not tenants.exists():
            raise Tenant.DoesNotExist(f"no tenant {tenant_slug!r}")
    return [
        purge_tenant(t, now=now, dry_run=dry_run, thread_id=thread_id, batch_size=batch_size)
        for t in tenants
    ]
