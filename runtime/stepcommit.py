"""One step's commit, whoever executes the run: the run's compare-and-swap, the checkpoint row
and its digest, the new artifacts and the journal entry — all of it or nothing.

Holdpoint's worker (`runtime.executor`) and an external agent (`runtime.protocol`) both commit
through `write`, so a checkpoint is the same row with the same digest over the same fields, and
the same journal entry, whichever of them wrote it. A commit is described by one `StepCommit`.

How it is sent:

- PostgreSQL, when every ledger write with it can be a part (the step's confirmations,
  `before_parts`; an action prepared where no hold point can apply, `within_parts`), no new
  artifact, and a writer that carries the run stream's head (`audit.journal.owning`): one
  autocommit statement — the run CAS, the checkpoint, each confirmation's compare-and-swap,
  the new action's guard and insert, the head swap and the journal entries
  (`audit.journal.append_after`) — one round trip instead of four or more (BEGIN, the
  statements, COMMIT). A part that writes nothing (a confirmation whose action moved, a
  guard that found a hold point) fails the statement whole, and the transaction path then
  writes it or says why.
- SQLite, for the same writer, when the commit is a step's alone (no ledger write with it,
  no new artifact, one journal entry): one INSERT into a view whose trigger writes the
  same rows with the same checks (runtime.sqlitestep), its own transaction — instead of
  BEGIN IMMEDIATE, four statements and COMMIT.
- The worker's step commit that leaves its run running, with no ledger write and no new
  artifact in it, goes by `send`: the same statement, but the worker takes its answer only
  when it next needs the connection, running the next step meanwhile (runtime.executor).
- Otherwise one short transaction: the run CAS first (its row lock orders the commit before a
  goal revision, which locks the run and then its actions), the checkpoint only if it held, the
  artifacts, then the journal entries of the ledger writes that happened before the step's
  (`before`: its confirmations), of the step, and of the ledger writes that go with it
  (`within`), written together at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.db import transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils import timezone

from audit import journal
from audit.canonical import canonical, sha256_hex
from fastsql import statements
from runtime import sqlitestep
from runtime.events import RunEvent, record
from runtime.models import Artifact, Checkpoint, Run


class Moved(Exception):
    """The run is no longer where the commit expected it (its fence, status, checkpoint rev
    or goal rev moved): nothing was written."""


@dataclass(frozen=True)
class StepCommit:
    """What one commit writes, and what the run row must still say for it to be written.

    `run` is the run as the writer last saw it: the commit is checkpoint `run.checkpoint_rev +
    1` under `run.goal_rev`, conditional on both being unchanged, on `fence` and on the run's
    status being `expect_status` (one status, or any of several).
    """

    run: Run
    actor: str
    fence: int
    step: str  # the step that ran ("" for an external executor's checkpoint)
    next_step: str
    status: str  # the run's status after the commit
    state: Any  # the state as the checkpoint stores it (runtime.artifacts.Encoder's output)
    changes: Mapping[str, Any]  # run columns to set besides checkpoint_rev and updated_at
    expect_status: str | tuple[str, ...]
    event: RunEvent
    payload: Mapping[str, Any] = field(default_factory=dict)  # more for the journal entry
    artifacts: Mapping[str, str] = field(default_factory=dict)  # new blobs: digest → content
    within: Callable[[], None] | None = None  # ledger writes that commit with the step
    # Ledger writes of what happened before the step's entry (its confirmations): journalled
    # ahead of it, so the run's last entry is still its step's.
    before: Callable[[], None] | None = None
    # The same writes as `before`, as parts of the one-statement commit (PostgreSQL): given
    # the statement and the name of the run's compare-and-swap part, the parts that follow
    # it, the last of which writes only if all of them did; their journal entries recorded.
    before_parts: Callable[[statements.OneStatement, str], list[statements.Part]] | None = None
    # The same writes as `within`, as parts of the one-statement commit: given the statement
    # and the name of the last part so far, the parts that follow it (the last of which
    # writes only if all of them did), their journal entries recorded — or None when they
    # cannot be written that way this time (the commit then takes its transaction).
    within_parts: statements.PartsAfter | None = None
    # The goal revision the checkpoint's state belongs to, when it is not `run.goal_rev`: a
    # migration reshapes an older revision's state without revising it, and its checkpoint
    # must say so, or the revision hook would never run for that state (None: the run's).
    state_goal_rev: int | None = None

    @property
    def rev(self) -> int:
        return self.run.checkpoint_rev + 1


# What a checkpoint's digest covers, by the names of its row's columns: `checkpoint_fields`
# builds them for a commit, `stored_fields` reads them back for verification.
DIGESTED = ("rev", "goal_rev", "step", "next_step", "status", "state", "waits", "fence")


def checkpoint_fields(commit: StepCommit) -> dict[str, Any]:
    """What a checkpoint's digest covers (DIGESTED) — and, with the run and its creator, its
    row. The same fields for every writer: verification recomputes the digest from them.
    (A literal, not a loop over DIGESTED: this is on every step.)"""
    return {
        "rev": commit.rev,
        "goal_rev": commit.run.goal_rev if commit.state_goal_rev is None else commit.state_goal_rev,
        "step": commit.step,
        "next_step": commit.next_step,
        "status": commit.status,
        "state": commit.state,
        "waits": commit.changes.get("waiting_for"),
        "fence": commit.fence,
    }


def stored_fields(row: Checkpoint) -> dict[str, Any]:
    """`checkpoint_fields` of a stored checkpoint, read back from its row (runtime.checkverify)."""
    return {name: getattr(row, name) for name in DIGESTED}


def checkpoint_digest(run_id: Any, fields: Mapping[str, Any]) -> str:
    """sha256 of the canonical form (RFC 8785) of the run's id and the checkpoint's fields.
    A checkpoint written before Holdpoint wrote RFC 8785 keeps the digest it was given: one
    who recomputes it checks it against each of `audit.canonical.digests` of those fields."""
    return sha256_hex(canonical({"run": str(run_id), **fields}))


def write(commit: StepCommit, *, before_send: Callable[[], None] | None = None) -> None:
    """Send the commit (see the module docstring); raises Moved if the run moved.
    `before_send`: called once, after the commit is built and before anything of it is sent
    (the executor waits there for its previous commit's answer: `send`)."""
    _write(commit, before_send, split=False)


def send(
    commit: StepCommit, *, before_send: Callable[[], None] | None = None
) -> Callable[[], None] | None:
    """`write`, but where the commit goes as one statement on PostgreSQL, in two halves: the
    statement is sent, and the function returned waits for the server's answer — nothing
    else may use the connection until it is called. It raises Moved if the run moved, and
    writes the commit by its transaction if the journal's head moved meanwhile (as `write`
    does). None: the commit was written whole here (no statement to split)."""
    return _write(commit, before_send, split=True)


def _write(
    commit: StepCommit, before_send: Callable[[], None] | None, *, split: bool
) -> Callable[[], None] | None:
    run = commit.run
    rev = commit.rev
    fields = checkpoint_fields(commit)
    digest = checkpoint_digest(run.run_id, fields)
    update = {"checkpoint_rev": rev, "updated_at": statements.NOW, **commit.changes}
    mine = {
        "run_id": run.run_id,
        "tenant_id": statements.Check(run.tenant_id),  # the key is the run id
        "fence": commit.fence,
        "status": commit.expect_status,
        "checkpoint_rev": run.checkpoint_rev,
        "goal_rev": run.goal_rev,
    }
    checkpoint = {
        **fields,
        "run_id": run.run_id,
        "tenant_id": run.tenant_id,
        "created_by": commit.actor,
        "digest": digest,
        "created_at": timezone.now(),  # every insert column given: fastsql's short way
    }
    entry = {
        "rev": rev,
        "step": commit.step,
        "next_step": commit.next_step,
        "status": commit.status,
        "digest": digest,
        **commit.payload,
    }
    stream = journal.run_stream(run.run_id)
    parts_only = (commit.before is None or commit.before_parts is not None) and (
        commit.within is None or commit.within_parts is not None
    )
    written: Callable[[], str] | None = None
    if parts_only and not commit.artifacts:
        connection = transaction.get_connection()
        split = split and statements.sends(connection)  # else sent and answered here
        written = _one_statement(
            connection, commit, stream, (update, mine, checkpoint, entry), before_send, split
        )

    def in_transaction() -> None:
        with transaction.atomic(durable=True), journal.batched(stream):
            if not statements.update_then_insert(Run, update, mine, Checkpoint, checkpoint):
                raise Moved()
            if commit.artifacts:
                Artifact.objects.bulk_create(
                    [
                        Artifact(
                            tenant_id=run.tenant_id,
                            digest=d,
                            content=text,
                            size=len(text.encode()),
                        )
                        for d, text in commit.artifacts.items()
                    ],
                    ignore_conflicts=True,
                )
            if commit.before is not None:
                commit.before()
            record(run, commit.event, commit.actor, **entry)
            if commit.within is not None:
                commit.within()

    if written is None:  # not as one statement: by the transaction, now
        if before_send is not None:
            before_send()
        in_transaction()
        return None

    def answered() -> None:
        outcome = written()
        if outcome == "refused":
            raise Moved()
        if outcome == "moved":  # the journal's head moved: nothing was written
            in_transaction()

    if not split:
        answered()
        return None
    return answered


def _one_statement(
    connection: BaseDatabaseWrapper,
    commit: StepCommit,
    stream: str,
    rows: tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]],
    before_send: Callable[[], None] | None,
    split: bool,
) -> Callable[[], str] | None:
    """For a writer that carries the stream head: the whole commit as a single autocommit
    statement, sent (SQLite: `_sqlite_statement`). Returns the function that waits for its
    answer (the outcome word of `journal.append_after`: "written", "refused" — then the run
    moved — or "moved": the journal's head moved, nothing written), answered already unless
    `split`; None if this path does not apply (nothing sent)."""
    if connection.in_atomic_block:
        return None
    if connection.vendor == "sqlite":
        return _sqlite_statement(connection, commit, stream, rows, before_send)
    if connection.vendor != "postgresql":
        return None
    update, mine, checkpoint, entry = rows  # the run's, its CAS, the checkpoint's, the entry's
    head = journal.remembered(stream)
    if head is None:
        return None
    lead = statements.update_then_insert_parts(Run, update, mine, Checkpoint, checkpoint)
    one = statements.OneStatement()
    with journal.batched(stream, deferred=True) as pending:
        if commit.before_parts is not None:  # journalled ahead of the step's entry
            lead += commit.before_parts(one, lead[0].name)
        record(commit.run, commit.event, commit.actor, **entry)
        if commit.within_parts is not None:  # journalled after it, as `within` would be
            within = commit.within_parts(one, lead[-1].name)
            if within is None:
                return None  # nothing sent; the recorded entries go with the batch
            lead += within
    tenant = commit.run.tenant_id
    # Built (the entries chained, hashed) before `before_send` waits: that work overlaps the
    # previous commit's round trip. Built again if that answer moved the head.
    parts = journal.parts_after(stream, tenant, pending, head, lead, one)
    if before_send is not None:
        before_send()
        now = journal.remembered(stream)
        if now is None:
            return None
        if now != head:
            head, parts = now, journal.parts_after(stream, tenant, pending, now, lead, one)
    if split:
        return journal.send_after(stream, pending, head, parts, one)
    outcome = journal.append_after(stream, pending, head, parts, one)
    return lambda: outcome


def _sqlite_statement(
    connection: BaseDatabaseWrapper,
    commit: StepCommit,
    stream: str,
    rows: tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]],
    before_send: Callable[[], None] | None,
) -> Callable[[], str] | None:
    """SQLite: `_one_statement`'s commit as one INSERT (runtime.sqlitestep) when it is a
    step's alone — no ledger write rides on it — answered at once; None if it cannot go so."""
    if commit.before_parts is not None or commit.within_parts is not None:
        return None
    values = sqlitestep.prepared(connection, rows)
    if values is None:
        return None
    if before_send is not None:
        before_send()
    head = journal.remembered(stream)
    if head is None:
        return None
    with journal.batched(stream, deferred=True) as pending:
        record(commit.run, commit.event, commit.actor, **rows[3])
    outcome = sqlitestep.write(connection, stream, pending, head, values)
    return None if outcome is None else lambda: outcome
