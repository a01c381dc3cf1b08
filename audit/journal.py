"""Appending to the journal: the one writer of its entries and stream heads.

`append()` must run inside the transaction of the change it records, so the change and its
record commit together or not at all. What an entry's hash covers is audit.chain; checking a
stream is audit.verification.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from django.db import DEFAULT_DB_ALIAS, IntegrityError, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils import timezone

from audit import sqliteappend
from audit.canonical import canonical, sha256_hex
from audit.chain import entry_hash_from_digest
from audit.models import JournalEntry, StreamHead
from fastsql import statements
from fastsql.prep import JsonText

# The types of entry the code writes into a tenant's stream (human and admin acts, and the
# system's acts on a tenant: rotations, purges, alerts) — a run's stream holds
# runtime.events.RunEvent's. The one list every reader offers (the audit log's and the
# journal admin's type filters); tests/audit/test_event_types.py reads every writer's call
# and fails for a type written but not listed here.
TENANT_EVENTS = (
    "action_resolved",
    "admin_added",
    "admin_changed",
    "admin_deleted",
    "approval_decided",
    "approval_reassigned",
    "approval_renotified",
    "approval_status",
    "audit_exported",
    "chain_break_detected",
    "credentials_reencrypted",
    "login",
    "login_failed",
    "policy_changed",
    "retention_purged",
    "token_created",
    "token_revoked",
    "token_rotated",
    "tool_defined",
    "webhook_changed",
    "webhook_deleted",
    "webhook_redelivered",
)


class StreamMoved(Exception):
    """The stream head the caller expected is no longer the head: retry with a fresh one."""


@dataclass(frozen=True)
class Head:
    seq: int
    hash: str


@functools.lru_cache(maxsize=4096)
def run_stream(run_id: object) -> str:
    """A run's stream name (also its object_ref), remembered: a step names it for each
    entry it appends, and a UUID's text is rebuilt on every str()."""
    return f"run:{run_id}"


def tenant_stream(tenant_id: int) -> str:
    return f"tenant:{tenant_id}"


def open_stream(stream: str, tenant_id: int) -> Head:
    """Create a stream's head if missing (idempotent; safe against a concurrent creator)."""
    try:
        with transaction.atomic():
            head, _ = StreamHead.objects.get_or_create(stream=stream, tenant_id=tenant_id)
    except IntegrityError:  # created meanwhile — or it is another tenant's stream: not found
        head = StreamHead.objects.get(stream=stream, tenant_id=tenant_id)
    return Head(head.seq, head.hash)


# --- the heads a writer holds ---------------------------------------------------------------
# An executor holding a run's lease is nearly the only writer of the run's stream: it appends
# several entries per step. It *owns* the stream while it runs (`owning`), and each append
# remembers the head it wrote, so the next append need not read (and lock) the head row
# first: the compare-and-swap on the head row — on seq *and* hash — proves nobody appended
# meanwhile. If somebody did (a reviewer's decision, a rolled-back transaction whose head we
# remembered), the swap changes no row and the append falls back to locking the head. A
# remembered head can cost one wasted statement, never a forked or broken chain.
#
# Inside `batched(stream)` (one transaction: a step's checkpoint with its ledger writes) the
# entries are chained and written together when the block ends — one head swap and one
# multi-row insert for all of them, and on PostgreSQL both in one statement.
class _ThreadState(threading.local):
    def __init__(self) -> None:  # runs once in each thread that touches it
        self.heads: dict[str, Head | None] = {}  # stream -> remembered Head (None: not known)
        self.depth: dict[str, int] = {}  # stream -> nesting of `owning`
        self.batches: dict[str, list[JournalEntry]] = {}  # stream -> entries for `batched`'s end


_local = _ThreadState()


def _thread_state() -> _ThreadState:
    return _local


@contextmanager
def owning(stream: str) -> Iterator[None]:
    """While inside, this thread's appends to `stream` remember its head (see above)."""
    state = _thread_state()
    state.depth[stream] = state.depth.get(stream, 0) + 1
    state.heads.setdefault(stream, None)
    try:
        yield
    finally:
        state.depth[stream] -= 1
        if not state.depth[stream]:
            del state.depth[stream]
            state.heads.pop(stream, None)


@contextmanager
def batched(stream: str, *, deferred: bool = False) -> Iterator[list[JournalEntry]]:
    """Appends to `stream` inside the block are collected (the list yielded) and written when
    it ends without an exception, together — inside the caller's transaction. `deferred`: not
    written at all; the caller writes them itself (`write`, or `append_after` for a change
    made in one statement). An exception discards them with the change."""
    batches = _thread_state().batches
    if stream in batches:  # nested: the outermost block writes
        yield batches[stream]
        return
    pending: list[JournalEntry] = []
    batches[stream] = pending
    try:
        yield pending
    finally:
        del batches[stream]
    if pending and not deferred:
        write(stream, pending[0].tenant_id, pending)


def append(
    stream: str,
    type: str,
    *,
    tenant_id: int,
    actor: str,
    payload: dict[str, Any] | None = None,
    object_ref: str = "",
    expected_head: Head | None = None,
) -> JournalEntry:
    """Append one entry; returns it. Must be called inside the recorded change's transaction.

    With `expected_head` (a writer that already knows the head) the head row is not read
    first: the conditional update proves nobody appended meanwhile, else StreamMoved. A stream
    this thread is `owning` uses the head it remembers the same way, but falls back to the
    locked read instead of raising. Otherwise the head row is locked, then moved. Inside
    `batched(stream)` the entry (seq, hash) is completed when the batch is written.
    """
    state = _thread_state()
    pending = state.batches.get(stream)
    if pending is None and not transaction.get_connection().in_atomic_block:
        raise RuntimeError("journal.append() must run inside the change's transaction")
    values = {
        "stream": stream,
        "tenant_id": tenant_id,
        "type": type,
        "actor": actor,
        "object_ref": object_ref,
        "payload": payload or {},
        "created_at": timezone.now(),
        "prev_hash": "",
        "hash": "",
        "redacted": False,
    }
    entry = statements.built(JournalEntry, values)
    if pending is not None and expected_head is None:
        pending.append(entry)
    else:
        write(stream, tenant_id, [entry], expected_head)
    return entry


def remembered(stream: str) -> Head | None:
    """The head this thread wrote last to a stream it is `owning` (None if it knows none)."""
    return _thread_state().heads.get(stream)


def write(
    stream: str, tenant_id: int, entries: list[JournalEntry], expected: Head | None = None
) -> None:
    """Inside the change's transaction: chain `entries` onto the stream and store them — from
    the expected or remembered head if it still is the head, else from the locked head row."""
    conn = transaction.get_connection()
    if not conn.in_atomic_block:
        raise RuntimeError("the journal is written inside the change's transaction")
    heads = _thread_state().heads
    owned = stream in heads
    head = expected or (heads.get(stream) if owned else None)
    if head is None or not _store(conn, stream, tenant_id, head, entries):
        if expected is not None:
            raise StreamMoved(stream)
        if not _store(conn, stream, tenant_id, _lock_head(stream, tenant_id), entries):
            raise StreamMoved(stream)  # cannot happen under the row lock
    if owned:
        heads[stream] = Head(entries[-1].seq, entries[-1].hash)


def chained(head: Head, entries: list[JournalEntry]) -> list[dict[str, Any]]:
    """Link `entries` after `head` (seq, prev_hash, hash); returns their rows to insert, each
    payload as the canonical text its hash covers (JsonText: not encoded a second time)."""
    prev = head
    rows = []
    for entry in entries:
        entry.seq, entry.prev_hash = prev.seq + 1, prev.hash
        text = canonical(entry.payload)
        entry.hash = entry_hash_from_digest(prev.hash, entry, sha256_hex(text))
        rows.append({**entry.__dict__, "payload": JsonText(text.decode())})
        prev = Head(entry.seq, entry.hash)
    return rows


def _at_head(stream: str, tenant_id: int, head: Head) -> dict[str, Any]:
    """The stream's head row, if it still is `head`. The stream is the key; the tenant a
    check, kept out of the planner's index choice (fastsql.statements.tenant_check says why).
    The condition names the head's seq *and* hash: a head remembered from a transaction that
    rolled back can never match a different entry that later took the same seq."""
    return {
        "stream": stream,
        "tenant_id": statements.Check(tenant_id),
        "seq": head.seq,
        "hash": head.hash,
    }


def _store(
    conn: BaseDatabaseWrapper, stream: str, tenant_id: int, head: Head, entries: list[JournalEntry]
) -> bool:
    """Move the head from `head` to the last entry and insert the entries; False (nothing
    written) if `head` is no longer the head. One statement on PostgreSQL, and on SQLite
    where its view is installed (audit.sqliteappend: the entries then get no id in memory)."""
    rows = chained(head, entries)
    if conn.vendor == "sqlite":
        written = sqliteappend.write(conn, rows)
        if written is not None:
            if written:
                _saved(entries)
            return written
    last = entries[-1]
    ids = statements.update_then_insert_rows(
        StreamHead,
        {"seq": last.seq, "hash": last.hash},
        _at_head(stream, tenant_id, head),
        JournalEntry,
        rows,
    )
    if ids is None:
        return False
    for entry, pk in zip(entries, ids, strict=True):
        entry.id = pk
    _saved(entries)
    return True


def _saved(entries: list[JournalEntry]) -> None:
    """The entries are rows now (Django's own mark after a save), whatever wrote them."""
    for entry in entries:
        entry._state.adding = False
        entry._state.db = DEFAULT_DB_ALIAS


def parts_after(
    stream: str,
    tenant_id: int,
    entries: list[JournalEntry],
    head: Head,
    lead: list[statements.Part],
    one: statements.OneStatement,
) -> list[statements.Part]:
    """PostgreSQL, outside any transaction: a change and its journal entries as the parts of
    *one* statement (`append_after` runs them, `send_after` sends them) — one round trip and
    its own (implicit, durable) transaction, where the step's BEGIN, statements and COMMIT
    would be four.

    `lead` is the change as parts — a compare-and-swap first, then what depends on it
    (see fastsql.statements.update_then_insert_parts). The statement runs the
    compare-and-swap first (so its row is locked before the stream head, the order every
    other writer of a run and its stream takes), then locks the stream head and checks it
    is `head` (seq and hash), then moves it and inserts the entries (chained onto `head`
    here). All of it is written or none of it: if the swap happened but the head is no
    longer `head`, the statement fails on purpose and rolls back. `one`: the statement the
    parts of `lead` were made for (with what it also reads)."""
    rows = chained(head, entries)
    last = entries[-1]
    swap, rest = lead[0], lead[1:]
    locked = one.lock(
        "journal_head", StreamHead, _at_head(stream, tenant_id, head), after=(swap.name,)
    )
    moved = one.update(
        "journal_moved",
        StreamHead,
        {"seq": last.seq, "hash": last.hash},
        {"stream": stream},
        after=(locked.name, lead[-1].name),
    )
    added = one.insert("journal_added", JournalEntry, rows, after=moved.name)
    return [swap, locked, *rest, moved, added]


def append_after(
    stream: str,
    entries: list[JournalEntry],
    head: Head,
    parts: list[statements.Part],
    one: statements.OneStatement,
) -> str:
    """Run `parts_after`'s statement. Returns "written", "refused" (the swap changed
    nothing: nothing written) or "moved" (the head moved: nothing written)."""
    return _appended(stream, entries, head, one.run(parts))


def send_after(
    stream: str,
    entries: list[JournalEntry],
    head: Head,
    parts: list[statements.Part],
    one: statements.OneStatement,
) -> Callable[[], str]:
    """`append_after`, in two halves (`OneStatement.send`): the statement is sent now and the
    returned function waits for its answer and returns what `append_after` would. The
    stream's remembered head is its last entry's from now on — the next statement can be
    built on it meanwhile — and goes back to `head` if the answer is not "written"."""
    answer = one.send(parts)
    heads = _thread_state().heads
    if stream in heads:
        heads[stream] = Head(entries[-1].seq, entries[-1].hash)

    def appended() -> str:
        outcome = _appended(stream, entries, head, answer())
        if outcome != "written" and stream in heads:
            heads[stream] = head
        return outcome

    return appended


def appended(stream: str, entries: list[JournalEntry], head: Head) -> str:
    """A writer stored `entries`, `chained` onto `head`, by a statement of its own
    (runtime.sqlitestep): the entries and the remembered head brought up to them, as
    `append_after` does for its statement. Returns "written"."""
    return _appended(stream, entries, head, (1, len(entries)))


def _appended(
    stream: str, entries: list[JournalEntry], head: Head, counts: tuple[int, int] | None
) -> str:
    """What the statement answered (`OneStatement.run`'s counts), as its outcome word; the
    entries and the remembered head brought up to it when written."""
    if counts is None:  # swapped, but the head had moved: nothing was written
        return "moved"
    changed, written = counts
    if not changed:
        return "refused"
    if written != len(entries):  # cannot happen: the statement fails first
        raise StreamMoved(stream)
    _saved(entries)
    heads = _thread_state().heads
    if stream in heads:
        last = entries[-1]
        heads[stream] = Head(last.seq, last.hash)
    return "written"


def _lock_head(stream: str, tenant_id: int) -> Head:
    """The stream's head, row-locked (created first if the stream is new)."""
    where = {"stream": stream, "tenant_id": statements.Check(tenant_id)}
    rows = statements.select(StreamHead, ("seq", "hash"), where, for_update=True)
    if not rows:
        open_stream(stream, tenant_id)
        rows = statements.select(StreamHead, ("seq", "hash"), where, for_update=True)
    if not rows:
        raise RuntimeError(f"stream {stream} belongs to another tenant")
    seq, hash = rows[0]
    return Head(int(seq), hash)
