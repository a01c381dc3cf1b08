"""Appending to and verifying the journal.

`append()` is the only writer. It must run inside the transaction of the change it records,
so the change and its record commit together or not at all.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, DataError, IntegrityError, connections, transaction
from django.utils import timezone

from audit.canonical import canonical_bytes, sha256_hex
from audit.models import GENESIS, JournalEntry, StreamHead


class StreamMoved(Exception):
    """The stream head the caller expected is no longer the head: retry with a fresh one."""


@dataclass(frozen=True)
class Head:
    seq: int
    hash: str


def run_stream(run_id: object) -> str:
    return f"run:{run_id}"


def tenant_stream(tenant_id: int) -> str:
    return f"tenant:{tenant_id}"


def entry_hash(
    prev_hash: str,
    *,
    stream: str,
    seq: int,
    type: str,
    actor: str,
    object_ref: str,
    payload: Any,
    created_at: datetime,
) -> str:
    """sha256(prev_hash || canonical entry). Every stored field but `id` is covered; the
    payload through its own digest, so the retention purge can drop a payload and keep the
    digest, and the chain still verifies."""
    fields = {
        "stream": stream,
        "seq": seq,
        "type": type,
        "actor": actor,
        "object_ref": object_ref,
        "created_at": created_at.isoformat(),
    }
    return _link(prev_hash, fields, payload_digest(payload))


def _link(prev_hash: str, fields: dict[str, Any], payload_sha256: str) -> str:
    body = canonical({**fields, "payload_sha256": payload_sha256})
    return sha256_hex(prev_hash.encode("ascii") + body)


def payload_digest(payload: Any) -> str:
    return sha256_hex(canonical(payload))


_SAFE_INT = 2**53 - 1
# The entry's columns in the model's order: `append` builds entries positionally (the cheap
# way through Model.__init__).
_ENTRY_FIELDS = tuple(f.attname for f in JournalEntry._meta.concrete_fields)
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
_DUMPS = _ENCODER.encode
# How json escapes a string with ensure_ascii off (the C function when there is one).
_ESCAPE = json.encoder.encode_basestring
if json.encoder.c_make_encoder is not None:
    # `_DUMPS`, minus what each call of it sets up again: the C encoder it builds per call,
    # built once. Same arguments, but no circular-reference markers: it only encodes values
    # `_plain` accepted — and `_plain` never returns for a value that contains itself.
    _ONE_SHOT = json.encoder.c_make_encoder(
        None, _ENCODER.default, _ESCAPE, None, ":", ",", True, False, True
    )

    def _encode(value: Any) -> str:
        return "".join(_ONE_SHOT(value, 0))
else:  # pragma: no cover - CPython always has the C encoder
    _encode = _DUMPS


def canonical(value: Any) -> bytes:
    """`audit.canonical.canonical_bytes(value)`, byte for byte, at a fraction of its cost
    for what is hashed on every step: values with no float. Such a value needs no
    normalisation, so once it passes the same checks — string keys, no NUL, no lone
    surrogate, integers within ±2**53 — the same `json.dumps` gives the same bytes. Anything
    else (a float, a value that fails a check) goes to `canonical_bytes` itself, which
    normalises it or refuses it with the precise reason."""
    if _plain(value):
        try:
            return _encode(value).encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: let canonical_bytes say where
            pass
    return canonical_bytes(value)


def _plain(value: Any) -> bool:
    """`_plain_any(value)`, with the common case — an object of str/int/None values, as every
    step hashes several of — checked in one loop instead of one call per value. Only values
    of exactly these classes take the shortcut; anything else (a str or int subclass, a
    nested value) gets `_plain_any`, so the answer is the same."""
    if value.__class__ is not dict:
        return _plain_any(value)
    for key, item in value.items():
        if not isinstance(key, str) or "\x00" in key:
            return False
        cls = item.__class__
        if cls is str:
            if "\x00" in item:
                return False
        elif cls is int:
            if not -_SAFE_INT <= item <= _SAFE_INT:
                return False
        elif item is not None and not _plain(item):
            return False
    return True


def _plain_any(value: Any) -> bool:
    if value is None or isinstance(value, bool):
        return True
    if isinstance(value, int):
        return -_SAFE_INT <= value <= _SAFE_INT
    if isinstance(value, str):
        return "\x00" not in value
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str) or "\x00" in key or not _plain(item):
                return False
        return True
    if isinstance(value, list | tuple):
        return all(_plain(item) for item in value)
    return False  # a float (normalised by canonical_bytes) or not JSON at all


def stored_payload_digest(entry: JournalEntry) -> str:
    """The digest the hash covers: recomputed, or kept by the purge when it redacted."""
    if entry.redacted:
        return str(entry.payload["sha256"])
    return payload_digest(entry.payload)


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
_local = threading.local()


def cursor(conn: Any) -> Any:
    """A cursor of `conn` for the hot path's statements, reused while the database connection
    (and whether queries are being captured) stays the same: opening a Django cursor costs
    more than executing a small statement. Statements still go through Django's cursor
    wrapper — its error translation, `execute_wrapper` hooks and query capture see each one.
    """
    raw, logged = conn.connection, conn.queries_logged
    held = getattr(_local, "cursor", None)
    if held is None or held[0] is not raw or held[1] != logged or raw is None:
        if conn.vendor == "postgresql":
            fresh = _prepared_cursor(conn)
        elif conn.vendor == "sqlite":
            fresh = _qmark_cursor(conn)
        else:
            fresh = None
        if fresh is None:
            fresh = conn.cursor()
        held = _local.cursor = (conn.connection, logged, fresh)
    return held[2]


def _prepared_cursor(conn: Any) -> Any:
    """PostgreSQL: a cursor that binds parameters on the server and prepares each statement
    the first time the connection runs it, then only executes it. The hot path repeats a
    handful of statements (a step's single statement among them) thousands of times per
    connection, and planning that statement took as long as running it (≈ 0.3 ms each,
    EXPLAIN ANALYZE; bench/README.md). Django's own queries keep client-side binding. None
    when turned off (HOLDPOINT_PG_PREPARE=0: behind a pooler in transaction mode, where a
    prepared statement may not be on the next server connection)."""
    if not getattr(settings, "HOLDPOINT_PG_PREPARE", True):
        return None
    from psycopg.postgres import types
    from psycopg.pq import Format

    conn.ensure_connection()
    # Prepare every statement this cursor runs, the first time (the connection's
    # prepare_threshold is 0: config/settings.py) — unless queries are being logged
    # (DEBUG, CaptureQueriesContext): psycopg keeps no query text for the execution of a
    # prepared statement, so Django's log would record None for each.
    raw_cursor = _prepared_cursor_class()(conn.connection)
    raw_cursor.prepare = not conn.queries_logged
    timestamptz = types["timestamptz"].oid
    loader = conn.connection.adapters.get_loader(timestamptz, Format.TEXT)
    if conn.timezone != getattr(loader, "timezone", conn.timezone):
        from django.db.backends.postgresql.psycopg_any import register_tzloader

        register_tzloader(conn.timezone, raw_cursor)
    return conn._prepare_cursor(raw_cursor)


def _prepared_cursor_class() -> Any:
    global _PreparedCursor
    if _PreparedCursor is None:
        from django.db.backends.postgresql.base import ServerBindingCursor

        class PreparedCursor(ServerBindingCursor):
            prepare = True

            def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
                kwargs.setdefault("prepare", self.prepare)
                return super().execute(query, params, **kwargs)

        _PreparedCursor = PreparedCursor
    return _PreparedCursor


_PreparedCursor: Any = None


def _qmark_cursor(conn: Any) -> Any:
    """SQLite: Django's cursor, but it rewrites each statement's `%s` placeholders to `?`
    once, not on every execute. Django's SQLiteCursorWrapper runs a regular expression over
    the text of every statement it executes; the hot path executes the same few texts (each
    built once and cached: runtime.statements, `_sql_for`) several times per step. The
    rewrite is Django's own `convert_query`, so the text sent is the same; and the cursor is
    still wrapped by `_prepare_cursor`, like `conn.cursor()`, so hooks and capture see it."""
    from django.db.backends.sqlite3.base import SQLiteCursorWrapper

    global _QmarkCursor
    if _QmarkCursor is None:

        class QmarkCursor(SQLiteCursorWrapper):
            def convert_query(self, query: str, *, param_names: Any = None) -> str:
                if param_names is not None:  # "pyformat" (named) style: as Django does it
                    return super().convert_query(query, param_names=param_names)
                converted = _QMARK.get(query)
                if converted is None:
                    if len(_QMARK) >= _QMARK_MAX:  # shapes are few; never grow without end
                        _QMARK.clear()
                    converted = _QMARK[query] = super().convert_query(query)
                return converted

        _QmarkCursor = QmarkCursor
    conn.close_if_health_check_failed()
    conn.ensure_connection()
    with conn.wrap_database_errors:
        return conn._prepare_cursor(conn.connection.cursor(factory=_QmarkCursor))


_QmarkCursor: Any = None
_QMARK: dict[str, str] = {}  # statement text -> with `?` placeholders (any thread: str -> str)
_QMARK_MAX = 1024


def _thread_state() -> Any:
    if not hasattr(_local, "heads"):
        _local.heads = {}  # stream -> remembered Head (None: not known yet)
        _local.depth = {}  # stream -> nesting of `owning`
        _local.batches = {}  # stream -> entries waiting for the end of `batched`
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
    entry = JournalEntry(*[values.get(name) for name in _ENTRY_FIELDS])
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
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("the journal is written inside the change's transaction")
    heads = _thread_state().heads
    owned = stream in heads
    head = expected or (heads.get(stream) if owned else None)
    if head is None or not _store(stream, tenant_id, head, entries):
        if expected is not None:
            raise StreamMoved(stream)
        if not _store(stream, tenant_id, _lock_head(stream, tenant_id), entries):
            raise StreamMoved(stream)  # cannot happen under the row lock
    if owned:
        heads[stream] = Head(entries[-1].seq, entries[-1].hash)


def _chain(head: Head, entries: list[JournalEntry]) -> None:
    prev = head
    for entry in entries:
        entry.seq, entry.prev_hash = prev.seq + 1, prev.hash
        entry.hash = entry_hash(
            prev.hash,
            stream=entry.stream,
            seq=entry.seq,
            type=entry.type,
            actor=entry.actor,
            object_ref=entry.object_ref,
            payload=entry.payload,
            created_at=entry.created_at,
        )
        prev = Head(entry.seq, entry.hash)


def _store(stream: str, tenant_id: int, head: Head, entries: list[JournalEntry]) -> bool:
    """Move the head from `head` to the last entry and insert the entries; False (nothing
    written) if `head` is no longer the head.

    The swap names the head's seq *and* hash: a head remembered from a transaction that
    rolled back can never match a different entry that later took the same seq."""
    _chain(head, entries)
    last = entries[-1]
    move = [last.seq, last.hash, stream, tenant_id, head.seq, head.hash]
    conn = connections[DEFAULT_DB_ALIAS]
    sql = _sql_for(conn, len(entries))
    rows = [prep(getattr(entry, name), conn) for entry in entries for name, prep in sql["columns"]]
    cur = cursor(conn)
    if conn.vendor == "postgresql":  # one round trip: swap, then insert if swapped
        cur.execute(sql["move_insert"], move + rows)
        ids = [row[0] for row in cur.fetchall()]
        if not ids:
            return False
    else:
        cur.execute(sql["move"], move)
        if cur.rowcount != 1:
            return False
        cur.execute(sql["insert"], rows)
        first = cur.lastrowid - len(entries) + 1  # one statement: consecutive rowids
        ids = list(range(first, first + len(entries)))
    for entry, pk in zip(entries, ids, strict=True):
        entry.id = pk
        entry._state.adding = False
        entry._state.db = conn.alias
    return True


# Field types whose get_db_prep_save / get_db_prep_value return a value of exactly this
# Python class unchanged.
_UNCHANGED = {
    "CharField": str,
    "TextField": str,
    "IntegerField": int,
    "BigIntegerField": int,
    "SmallIntegerField": int,
    "PositiveIntegerField": int,
    "PositiveBigIntegerField": int,
    "PositiveSmallIntegerField": int,
    "BooleanField": bool,
    "AutoField": int,
    "BigAutoField": int,
}


def _django_field(field: Any) -> bool:
    return field is not None and type(field).__module__.startswith("django.db.models.")


def field_prep(field: Any, vendor: str, prep: Any) -> Any:
    """`prep(value, conn)` — the field's own get_db_prep_save, or get_db_prep_value — with a
    shortcut for the values the hot path sends on every step, giving what it would return:

    - str, int and bool values of a column of that type: returned unchanged by the field;
    - an aware `datetime` (timezone.now(), or a value read back) of a DateTimeField: Django's
      get_prep_value returns it unchanged; PostgreSQL's `adapt_datetimefield_value` too
      (psycopg adapts it), SQLite's turns it into the connection's time zone, drops the
      zone and takes `str()` — which, when it already is in that zone (the same tzinfo
      object: UTC from timezone.now(), or the zone read values are given), is
      `str(value.replace(tzinfo=None))`.

    Any other value — None, an expression, a naive datetime (Django warns), another zone —
    goes to `prep` itself."""
    target = getattr(field, "target_field", None) if field.is_relation else field
    if not _django_field(field) or not _django_field(target):
        return prep  # a custom field may prepare any value its own way
    kind = _UNCHANGED.get(target.get_internal_type())
    if kind is not None:

        def plain(value: Any, conn: Any) -> Any:
            return value if value.__class__ is kind else prep(value, conn)

        return plain
    if field.get_internal_type() != "DateTimeField":
        return prep
    if vendor == "postgresql":

        def aware(value: Any, conn: Any) -> Any:
            if value.__class__ is datetime and value.tzinfo is not None:
                return value
            return prep(value, conn)

        return aware
    if vendor == "sqlite":

        def naive_text(value: Any, conn: Any) -> Any:
            if value.__class__ is datetime and value.tzinfo is not None:
                if value.tzinfo is conn.timezone:
                    return str(value.replace(tzinfo=None))
            return prep(value, conn)

        return naive_text
    return prep


def append_after(
    stream: str,
    tenant_id: int,
    entries: list[JournalEntry],
    head: Head,
    lead: list[tuple[str, str, list[Any]]],
) -> str:
    """PostgreSQL, outside any transaction: a change and its journal entries as *one*
    statement — one round trip and its own (implicit, durable) transaction, where the
    step's BEGIN, statements and COMMIT would be four.

    `lead` is the change as named parts — a compare-and-swap first, then what depends on it
    (see runtime.statements.update_then_insert_parts). The statement runs the
    compare-and-swap first (so its row is locked before the stream head, the order every
    other writer of a run and its stream takes), then locks the stream head and checks it
    is `head` (seq and hash), then moves it and inserts the entries. All of it is written or
    none of it: if the swap happened but the head is no longer `head`, the statement fails
    on purpose and rolls back. Returns "written", "refused" (the swap changed nothing:
    nothing written) or "moved" (the head moved: nothing written).
    """
    conn = connections[DEFAULT_DB_ALIAS]
    if conn.vendor != "postgresql" or conn.in_atomic_block:
        raise RuntimeError("append_after is one autocommit statement on PostgreSQL")
    _chain(head, entries)
    last = entries[-1]
    sql = _sql_for(conn, len(entries))
    (swap, swap_text, swap_params), rest = lead[0], lead[1:]
    key = ("after", tuple(text for _, text, _ in lead))
    text = sql.get(key)
    if text is None:
        parts = [f"{swap} AS ({swap_text} RETURNING 1)"]
        parts.append(sql["locked_head"].format(after=swap))
        parts += [f"{name} AS ({part} RETURNING 1)" for name, part, _ in rest]
        parts.append(sql["moved_after"].format(after=lead[-1][0]))
        parts.append(sql["added_after_moved"])
        text = sql[key] = (
            "WITH "
            + ", ".join(parts)
            + f" SELECT (SELECT count(*) FROM {swap}), (SELECT count(*) FROM journal_added)"
            # Swapped but the head moved (nothing added): fail the statement — division by
            # zero — so that it rolls back as a whole.
            + f", CASE WHEN (SELECT count(*) FROM {swap}) > 0"
            " THEN 1 / (SELECT count(*) FROM journal_added) END"
        )
    params: list[Any] = [*swap_params, stream, tenant_id, head.seq, head.hash]
    for _, _, part_params in rest:
        params += part_params
    params += [last.seq, last.hash, stream]
    columns = sql["columns"]
    params += [prep(getattr(entry, name), conn) for entry in entries for name, prep in columns]
    cur = cursor(conn)
    try:
        cur.execute(text, params)
    except DataError:  # the deliberate failure: the head moved, nothing was written
        return "moved"
    changed, added, _ = cur.fetchone()
    if not changed:
        return "refused"
    if added != len(entries):  # cannot happen: the statement fails first
        raise StreamMoved(stream)
    for entry in entries:
        entry._state.adding = False
        entry._state.db = conn.alias
    heads = _thread_state().heads
    if stream in heads:
        heads[stream] = Head(last.seq, last.hash)
    return "written"


_SQL: dict[tuple[str, int], dict[str, Any]] = {}


def _sql_for(conn: Any, count: int) -> dict[str, Any]:
    """The statements that append `count` entries, built once from the models' metadata."""
    key = (conn.vendor, count)
    found = _SQL.get(key)
    if found is not None:
        return found
    qn = conn.ops.quote_name
    head_table, entry_table = qn(StreamHead._meta.db_table), qn(JournalEntry._meta.db_table)
    columns = [f for f in JournalEntry._meta.concrete_fields if f.attname != "id"]
    names = ", ".join(qn(f.column) for f in columns)
    # The stream is the key; the tenant a check, kept out of the planner's index choice
    # (runtime.statements.tenant_check says why).
    swap = (
        f"UPDATE {head_table} SET {qn('seq')} = %s, {qn('hash')} = %s WHERE {qn('stream')} = %s"
        f" AND ({qn('tenant_id')} + 0) = %s AND {qn('seq')} = %s AND {qn('hash')} = %s"
    )
    plain_row = "(" + ", ".join(["%s"] * len(columns)) + ")"
    # In a SELECT the values need their column types spelled out (a NULL would be text).
    typed_row = "(" + ", ".join(f"%s::{f.db_type(conn)}" for f in columns) + ")"
    found = _SQL[key] = {
        "columns": [(f.attname, field_prep(f, conn.vendor, f.get_db_prep_save)) for f in columns],
        "move": swap,
        "insert": f"INSERT INTO {entry_table} ({names}) VALUES " + ", ".join([plain_row] * count),
        "move_insert": f"WITH moved AS ({swap} RETURNING 1) INSERT INTO {entry_table} ({names}) "
        f"SELECT v.* FROM (VALUES {', '.join([typed_row] * count)}) AS v, moved "
        f"RETURNING {qn('id')}",
        # The parts of append_after's statement (the head row locked and checked first).
        "locked_head": f"journal_head AS (SELECT 1 FROM {head_table} WHERE {qn('stream')} = %s"
        f" AND ({qn('tenant_id')} + 0) = %s AND {qn('seq')} = %s AND {qn('hash')} = %s"
        " AND EXISTS (SELECT 1 FROM {after}) FOR UPDATE)",
        "moved_after": f"journal_moved AS (UPDATE {head_table} SET {qn('seq')} = %s,"
        f" {qn('hash')} = %s WHERE {qn('stream')} = %s"
        " AND EXISTS (SELECT 1 FROM journal_head) AND EXISTS (SELECT 1 FROM {after})"
        " RETURNING 1)",
        "added_after_moved": f"journal_added AS (INSERT INTO {entry_table} ({names}) SELECT v.*"
        f" FROM (VALUES {', '.join([typed_row] * count)}) AS v, journal_moved RETURNING 1)",
    }
    return found


def _lock_head(stream: str, tenant_id: int) -> Head:
    conn = connections[DEFAULT_DB_ALIAS]
    qn = conn.ops.quote_name
    lock = " FOR UPDATE" if conn.features.has_select_for_update else ""
    sql = (
        f"SELECT {qn('seq')}, {qn('hash')} FROM {qn(StreamHead._meta.db_table)} "
        f"WHERE {qn('stream')} = %s AND ({qn('tenant_id')} + 0) = %s{lock}"
    )
    with conn.cursor() as cursor:
        cursor.execute(sql, [stream, tenant_id])
        row = cursor.fetchone()
        if row is None:
            open_stream(stream, tenant_id)
            cursor.execute(sql, [stream, tenant_id])
            row = cursor.fetchone()
    if row is None:
        raise RuntimeError(f"stream {stream} belongs to another tenant")
    return Head(int(row[0]), row[1])


def entry_hash_from_digest(prev_hash: str, entry: JournalEntry, payload_sha256: str) -> str:
    fields = {
        "stream": entry.stream,
        "seq": entry.seq,
        "type": entry.type,
        "actor": entry.actor,
        "object_ref": entry.object_ref,
        "created_at": entry.created_at.isoformat(),
    }
    return _link(prev_hash, fields, payload_sha256)


@dataclass(frozen=True)
class Break:
    stream: str
    seq: int
    problem: str


def verify_entries(stream: str, entries: Iterable[JournalEntry]) -> Break | None:
    """The first broken link of a stream's entries (in seq order), or None if intact."""
    prev, expected_seq = GENESIS, 1
    for entry in entries:
        if entry.seq != expected_seq:
            return Break(
                stream, expected_seq, f"missing or reordered entry (found seq {entry.seq})"
            )
        if entry.prev_hash != prev:
            return Break(stream, entry.seq, "prev_hash does not match the previous entry")
        recomputed = entry_hash_from_digest(prev, entry, stored_payload_digest(entry))
        if recomputed != entry.hash:
            return Break(stream, entry.seq, "entry content does not match its hash")
        prev, expected_seq = entry.hash, expected_seq + 1
    return None


def verify_stream(stream: str) -> Break | None:
    entries = JournalEntry.objects.filter(stream=stream).order_by("seq").iterator()
    found = verify_entries(stream, entries)
    if found is not None:
        return found
    last = JournalEntry.objects.filter(stream=stream).order_by("-seq").first()
    return head_break(stream, last)


def head_break(stream: str, last: JournalEntry | None) -> Break | None:
    """Entries cut off at the end leave an intact chain; the stream head still knows."""
    head = StreamHead.objects.filter(stream=stream).first()
    last_seq, last_hash = (last.seq, last.hash) if last is not None else (0, GENESIS)
    if head is None or (head.seq, head.hash) == (last_seq, last_hash):
        return None
    return Break(stream, last_seq + 1, "entries missing after the last one")
