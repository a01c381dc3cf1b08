"""Runs, their checkpoints, content-addressed artifacts and recorded calls.

The run row is the single source of truth for who may execute (lease owner, expiry, fence)
and where the run is (checkpoint_rev, next_step, status). Every executor write is a
compare-and-swap on it; the queue only rings the doorbell.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.db.models.functions import Now

from audit.models import HistoryQuerySet, InsertOnly
from runtime.models.tenancy import Tenant


class RunStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    WAITING_INPUT = "waiting_input"
    WAITING_APPROVAL = "waiting_approval"
    RETRYING = "retrying"
    NEEDS_RECONCILIATION = "needs_reconciliation"
    NEEDS_ATTENTION = "needs_attention"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL = frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED})
# The same, in a fixed order (a constraint's definition must not vary between processes).
FINISHED = [RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED]
# Statuses an executor may pick a run up in (the lease CAS admits nothing else).
# needs_reconciliation is not among them: a human resolves the action first.
RUNNABLE = frozenset({RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.RETRYING})


class Run(models.Model):
    run_id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="runs")
    thread_id = models.CharField(max_length=200)
    graph = models.CharField(max_length=100)
    graph_version = models.CharField(max_length=40)
    state_version = models.PositiveIntegerField(default=1)
    goal = models.JSONField()
    goal_rev = models.PositiveIntegerField(default=1)
    status = models.CharField(max_length=24, choices=RunStatus.choices, default=RunStatus.QUEUED)
    checkpoint_rev = models.PositiveIntegerField(default=0)
    # The checkpoint rev at which the current step visit began. Checkpoints around side effects
    # advance checkpoint_rev mid-step; this does not, so a step that re-runs after a crash
    # derives the same idempotency keys, and a step that loops to itself derives new ones.
    step_rev = models.PositiveIntegerField(default=0)
    next_step = models.CharField(max_length=100)
    waiting_for = models.JSONField(null=True, blank=True)
    # Input delivered by a client while the run waited; consumed by the next step's commit.
    pending_input = models.JSONField(null=True, blank=True)
    # When a retrying run or a timer wait becomes runnable again (database time).
    wake_at = models.DateTimeField(null=True, blank=True)
    lease_owner = models.CharField(max_length=200, blank=True, default="")
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    fence = models.BigIntegerField(default=0)
    consecutive_failures = models.PositiveIntegerField(default=0)
    attempts = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True, default="")
    attention_reason = models.TextField(blank=True, default="")
    metadata = models.JSONField(default=dict, blank=True)
    # The W3C traceparent of the request that created the run (runtime.tracing): its
    # advances and decisions, in whichever process and however much later, continue that
    # trace. Empty when tracing was off. A database default too: a web or worker of the
    # release before, still inserting runs during a rolling deploy, does not name it.
    trace_context = models.CharField(max_length=55, blank=True, default="", db_default="")
    # Executed by an agent's own loop through the API: workers and the sweeper leave it alone
    # (the lease protocol still makes the agent the one executor).
    external = models.BooleanField(default=False)
    # The one agent account that may execute an external run through the protocol (issue
    # 16 H1): the agent that created it, or one a tenant admin names. Nobody else's token,
    # and no person's session, may lease it or write under its fence.
    executor_account = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="The agent account that may execute this external run.",
    )
    created_by = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    # The database's time, like every later write of it (each change sets it to Now()): what
    # the retention cutoff and the MCP idle sweep compare with the database's now. auto_now
    # stamped the inserting process's clock — a session opened by a gateway whose clock ran
    # behind was idle the moment it opened. The insert returns it (RETURNING): no statement
    # more. Nothing saves a whole run row, so nothing needed auto_now's stamping on save().
    updated_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.CheckConstraint(
                condition=Q(status__in=RunStatus.values), name="runtime_run_status_valid"
            ),
            models.CheckConstraint(
                condition=Q(fence__gte=0) & Q(goal_rev__gte=1), name="runtime_run_counters"
            ),
            # What a status implies, refused by the database rather than trusted to every
            # writer (executor, leases, lifecycle, protocol, approvals' expiry):
            # a lease is one thing — owner and expiry are set together or cleared together.
            # (lease_free() reads only the expiry, heartbeats match only the owner: half a
            # lease would be held by nobody, or free to everyone while someone writes.)
            models.CheckConstraint(
                condition=Q(lease_owner="", lease_expires_at__isnull=True)
                | (~Q(lease_owner="") & Q(lease_expires_at__isnull=False)),
                name="runtime_run_lease_both_or_neither",
            ),
            # A finished run holds no lease: terminal states never change again, so nobody
            # may be executing it.
            models.CheckConstraint(
                condition=~Q(status__in=FINISHED)
                | Q(lease_owner="", lease_expires_at__isnull=True),
                name="runtime_run_finished_no_lease",
            ),
            # A run waiting for a person says why: the reason is what that person reads.
            models.CheckConstraint(
                condition=~Q(status=RunStatus.NEEDS_ATTENTION) | ~Q(attention_reason=""),
                name="runtime_run_attention_has_reason",
            ),
        ]
        indexes = [
            # The sweeper: runs whose lease expired or that wait for a time to come.
            models.Index(
                fields=["lease_expires_at"],
                name="runtime_run_sweep_lease",
                condition=Q(status__in=["queued", "running", "retrying", "needs_reconciliation"]),
            ),
            models.Index(
                fields=["wake_at"],
                name="runtime_run_sweep_wake",
                condition=Q(wake_at__isnull=False),
            ),
            # Runs pages and API lists: a tenant's runs, newest first, by status.
            models.Index(fields=["tenant", "status", "-created_at"], name="runtime_run_list"),
            models.Index(fields=["tenant", "thread_id"], name="runtime_run_thread"),
            # The sweeper: unfinished MCP gateway sessions (runtime.agents.mcp_session.
            # close_idle filters them by updated_at; between calls most are queued, one whose
            # gateway died needs_attention). No index may name a column a step commit
            # changes (updated_at, checkpoint_rev, step_rev, next_step): PostgreSQL then
            # rewrites the row in place (a HOT update, no new index entries) on every step.
            models.Index(
                fields=["created_at"],
                name="runtime_run_mcp_open_sessions",
                condition=Q(graph="mcp-session") & ~Q(status__in=FINISHED),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.graph}@{self.graph_version} {self.run_id} ({self.status})"

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL


class Artifact(models.Model):
    """A large value stored once per tenant under the sha256 of its canonical bytes."""

    # No index of its own: runtime_artifact_once (tenant, digest) starts with the tenant.
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, db_index=False)
    digest = models.CharField(max_length=64)
    content = models.TextField()
    size = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "digest"], name="runtime_artifact_once"),
        ]

    def __str__(self) -> str:
        return f"artifact {self.digest[:12]} ({self.size} B)"


class CheckpointQuerySet(HistoryQuerySet["Checkpoint"]):
    pass


class Checkpoint(InsertOnly):
    """Append-only: what the next step needs, and who wrote it under which fence.

    Written by the step commit (one INSERT, runtime.stepcommit); never updated; deleted only
    with its run by the retention purge, inside its gate. PostgreSQL's trigger refuses the
    rest; on SQLite the model does (InsertOnly, HistoryQuerySet — also as the base manager,
    through which a deleted run's checkpoints are deleted)."""

    # No index of its own: runtime_checkpoint_one_rev (run, rev) starts with the run, and an
    # index fewer is one page fewer written by every step's commit. Neither key is checked
    # by the database: the writer's compare-and-swap on the run row proves both in the same
    # statement (migration 0035), and checkpoint_verify names a row whose run is gone or
    # whose tenant is not its run's. on_delete still holds: the ORM's collector applies it.
    run = models.ForeignKey(
        Run,
        on_delete=models.CASCADE,
        related_name="checkpoints",
        db_index=False,
        db_constraint=False,
    )
    tenant = models.ForeignKey(
        Tenant, on_delete=models.PROTECT, db_index=False, db_constraint=False
    )
    rev = models.PositiveIntegerField()
    goal_rev = models.PositiveIntegerField()
    step = models.CharField(max_length=100, blank=True, default="")
    next_step = models.CharField(max_length=100, blank=True, default="")
    status = models.CharField(max_length=24, choices=RunStatus.choices)
    # The graph's state with large values replaced by artifact references.
    state = models.JSONField()
    waits = models.JSONField(null=True, blank=True)
    created_by = models.CharField(max_length=240)
    fence = models.BigIntegerField()
    digest = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = CheckpointQuerySet.as_manager()

    class Meta:
        base_manager_name = "objects"
        ordering = ["run", "rev"]
        constraints = [
            models.UniqueConstraint(fields=["run", "rev"], name="runtime_checkpoint_one_rev"),
        ]

    def __str__(self) -> str:
        return f"checkpoint {self.run_id}@{self.rev}"


class RecordedCall(models.Model):
    """The result of a call that must not be paid twice (model call, document read).

    Committed as soon as the call returns, before the step commits, so a crash between the
    two reuses the result instead of paying again. Keyed per run, so still-valid evidence
    survives a goal revision when the graph uses a revision-independent key.
    """

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="recorded_calls")
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT)
    key = models.CharField(max_length=300)
    goal_rev = models.PositiveIntegerField()
    result = models.JSONField()
    fence = models.BigIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["run", "key"], name="runtime_recordedcall_once"),
        ]

    def __str__(self) -> str:
        return f"{self.run_id}:{self.key}"
