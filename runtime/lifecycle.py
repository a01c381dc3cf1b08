"""Starting, cancelling, resuming runs and giving them input: the non-executor transitions.

Each is one named function: a compare-and-swap on the run row, its journal event in the same
transaction, and the doorbell rung after commit when there is work for a worker.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.db.models.functions import Now

from audit.canonical import CanonicalError, canonical_bytes
from fastsql.statements import tenant_check
from runtime import observe
from runtime.errors import (
    AlreadyCompleted,
    InvalidParams,
    NotWaitingInput,
    RunFinished,
    UnknownGraph,
    VersionConflict,
)
from runtime.events import RunEvent, record
from runtime.graphs import registry
from runtime.ledger import cancel_older_revisions, withdraw_unsent
from runtime.models import (
    TERMINAL,
    Run,
    RunStatus,
    ShaperKind,
    Tenant,
)
from runtime.models.limits import NOTE_MAX
from runtime.queue import ring
from runtime.shapers import record_shaper

# What `resume_run` wakes besides a timer wait; pages use it to decide whether to offer it.
RESUMABLE = frozenset({RunStatus.NEEDS_ATTENTION, RunStatus.RETRYING})


def _json_value(value: Any, field: str) -> Any:
    try:
        canonical_bytes(value)
    except CanonicalError as exc:
        raise InvalidParams(str(exc), errors={field: [str(exc)]}) from None
    return value


def create_run(
    tenant: Tenant,
    graph: str,
    goal: Any,
    *,
    actor: str,
    thread_id: str | None = None,
    graph_version: str | None = None,
    metadata: dict[str, Any] | None = None,
    external: bool = False,
    executor_account: Any = None,
    settle: Callable[[Any, bool], None] | None = None,
) -> Run:
    """Start a run pinned to a registered graph version (the latest unless one is named).

    `external`: the agent runs its own loop through the executor protocol; Holdpoint's
    workers never pick it up. `executor_account`: the agent account that may execute it
    (runtime.protocol.authorize), normally the agent that starts it. `settle`: records the
    run on the request's Idempotency-Key claim in the run's own transaction.
    """
    found = registry.get(graph, graph_version) if graph_version else None
    if found is None:
        if graph_version:
            raise UnknownGraph(f"graph {graph!r} version {graph_version!r} is not registered")
        found = registry.latest(graph)
    with transaction.atomic(durable=True):
        run = Run.objects.create(
            tenant=tenant,
            graph=found.name,
            graph_version=found.version,
            state_version=found.state_version,
            goal=_json_value(goal, "goal"),
            thread_id=thread_id or str(uuid.uuid4()),
            next_step=found.start,
            metadata={"tools": list(found.tools), **(metadata or {})},
            created_by=actor,
            external=external,
            executor_account=executor_account if external else None,
            trace_context=observe.trace_context(),
        )
        record(
            run,
            RunEvent.CREATED,
            actor,
            graph=found.name,
            graph_version=found.version,
            goal_rev=1,
            external=external,
            status=RunStatus.QUEUED,
        )
        record_shaper(run, actor, ShaperKind.STARTED, 1)
        if settle is not None:
            settle(run.run_id, True)
        if not external:
            ring(run.run_id)
    return run


def _finished(run: Run) -> None:
    if run.status == RunStatus.COMPLETED:
        raise AlreadyCompleted()
    if run.status in TERMINAL:
        raise RunFinished(f"the run is {run.status}")


def cancel_run(run: Run, reason: str, *, actor: str) -> Run:
    """Stop a run for good; unsent actions are withdrawn, an executor's next write is refused."""
    with transaction.atomic(durable=True):
        changed = (
            Run.objects.filter(pk=run.pk, tenant_id=run.tenant_id)
            .exclude(status__in=TERMINAL)
            .update(
                status=RunStatus.CANCELLED,
                waiting_for=None,
                wake_at=None,
                attention_reason="",  # nobody need look at a cancelled run
                lease_owner="",
                lease_expires_at=None,
                updated_at=Now(),
            )
        )
        run.refresh_from_db()
        if changed != 1:
            raise RunFinished(f"the run is {run.status}")
        ids = withdraw_unsent(run, "run cancelled", actor)
        if run.external:  # its executor reports nothing more: a person settles the rest
            from runtime.protocol import hand_over_unproven

            hand_over_unproven(run, actor)
        record(
            run,
            RunEvent.CANCELLED,
            actor,
            reason=reason[:NOTE_MAX],
            withdrawn_actions=ids,
            status=RunStatus.CANCELLED,
        )
    return run


def provide_input(run: Run, data: Any, expected_rev: int, *, actor: str) -> Run:
    """Deliver what a waiting run asked for; refused if it moved since the caller looked."""
    _json_value(data, "data")
    with transaction.atomic(durable=True):
        changed = Run.objects.filter(
            tenant_check(run.tenant_id),
            pk=run.pk,
            status=RunStatus.WAITING_INPUT,
            checkpoint_rev=expected_rev,
        ).update(status=RunStatus.QUEUED, pending_input=data, waiting_for=None, updated_at=Now())
        run.refresh_from_db()
        if changed != 1:
            if run.status != RunStatus.WAITING_INPUT:
                raise NotWaitingInput(f"the run is {run.status}")
            raise VersionConflict(f"checkpoint_rev is {run.checkpoint_rev}, not {expected_rev}")
        record(run, RunEvent.INPUT_RECEIVED, actor, rev=expected_rev, status=RunStatus.QUEUED)
        record_shaper(run, actor, ShaperKind.INPUT, run.goal_rev)
        ring(run.run_id)
    return run


# What resume_run wakes: an escalated or retrying run, or a queued one waiting for its back-off.
WAKEABLE = Q(status__in=RESUMABLE) | Q(status=RunStatus.QUEUED, wake_at__isnull=False)


def has_something_to_resume(run: Run) -> bool:
    """Whether resume_run would wake the run now (the same rule, WAKEABLE): resume_run itself
    says nothing when it wakes nothing, as the API asks; the admin tells its user instead."""
    return Run.objects.filter(WAKEABLE, tenant_check(run.tenant_id), pk=run.pk).exists()


def resume_run(run: Run, *, actor: str, expected_rev: int | None = None) -> Run:
    """Let a run go on: after escalation (a human looked), or to wake a retrying one now.

    A completed run answers AlreadyCompleted — it never starts a second execution.
    """
    with transaction.atomic(durable=True):
        current = Run.objects.select_for_update().get(pk=run.pk, tenant_id=run.tenant_id)
        _finished(current)
        if expected_rev is not None and current.checkpoint_rev != expected_rev:
            raise VersionConflict(f"checkpoint_rev is {current.checkpoint_rev}")
        changed = Run.objects.filter(WAKEABLE, tenant_check(run.tenant_id), pk=run.pk).update(
            status=RunStatus.QUEUED,
            wake_at=None,
            consecutive_failures=0,
            attention_reason="",
            updated_at=Now(),
        )
        if changed:
            record(
                current,
                RunEvent.RESUMED,
                actor,
                previous_status=current.status,
                status=RunStatus.QUEUED,
            )
        ring(run.pk)
    run.refresh_from_db()
    return run


def revise_goal(run: Run, goal: Any, expected_goal_rev: int, *, actor: str) -> Run:
    """ "I said it wrong": a new goal revision that fences off everything of the old one.

    goal_rev + 1 atomically (CAS on the expected revision); every action prepared under an
    older revision and not yet sent is cancelled; the executor's in-flight step cannot commit
    (its CAS names the old goal_rev) and the graph's revision hook decides what evidence
    stays. A waiting run is made runnable so the revision is applied promptly.
    """
    _json_value(goal, "goal")
    with transaction.atomic(durable=True):
        current = Run.objects.select_for_update().get(pk=run.pk, tenant_id=run.tenant_id)
        if current.status in TERMINAL:
            raise RunFinished(f"the run is {current.status}")
        if current.goal_rev != expected_goal_rev:
            raise VersionConflict(f"goal_rev is {current.goal_rev}, not {expected_goal_rev}")
        new_rev = current.goal_rev + 1
        waiting = current.status in (RunStatus.WAITING_INPUT, RunStatus.WAITING_APPROVAL)
        changes: dict[str, Any] = {"goal": goal, "goal_rev": new_rev, "updated_at": Now()}
        if waiting or current.status in (RunStatus.RETRYING, RunStatus.NEEDS_ATTENTION):
            changes.update(
                status=RunStatus.QUEUED,
                waiting_for=None,
                wake_at=None,
                pending_input=None,
                attention_reason="",  # the reason leaves needs_attention with the run
            )
        Run.objects.filter(pk=run.pk, tenant_id=run.tenant_id, goal_rev=expected_goal_rev).update(
            **changes
        )
        record(
            current,
            RunEvent.GOAL_REVISED,
            actor,
            from_rev=expected_goal_rev,
            to_rev=new_rev,
            previous_goal=current.goal,
            goal=goal,
            status=changes.get("status", current.status),
        )
        record_shaper(current, actor, ShaperKind.REVISED, new_rev)
        cancel_older_revisions(current, new_rev, actor)
        ring(run.pk)
    run.refresh_from_db()
    return run
