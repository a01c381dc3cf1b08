"""The fast path's cursor: one per thread and connection, reused, and cheaper per statement.

Opening a Django cursor costs more than executing one of the hot path's small statements, and
Django's own cursors redo per statement what the hot path's few fixed texts need done once:
SQLite's wrapper rewrites every text's `%s` placeholders to `?` with a regular expression,
PostgreSQL's binds on the client and so plans every statement again. The cursors here keep
Django's wrapper around the driver's cursor — its error translation, `execute_wrapper` hooks
and query capture see every statement — and change only those two costs.

This is the one module that subclasses Django's database backend classes and calls their
underscore methods (`_prepare_cursor`) — and psycopg's (`_execute_gen`, for a statement sent
now and answered later: `PreparedCursor.send`); each use says what it relies on. A Django upgrade
that changes them breaks here, and tests/runtime/test_perf_invariants.py says so.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.db.backends.base.base import BaseDatabaseWrapper

_local = threading.local()


def cursor(conn: BaseDatabaseWrapper, text: str | None = None) -> Any:
    """A cursor of `conn` for the hot path's statements, reused while the database connection
    (and whether queries are being captured) stays the same. Statements still go through
    Django's cursor wrapper — its error translation, `execute_wrapper` hooks and query
    capture see each one.

    `text`: on PostgreSQL, a statement run again and again with others in between (a step's
    one statement: an action alternates two) gets a cursor of its own. A psycopg cursor sets
    up its parameter adapters afresh whenever its statement differs from its last one — a
    lookup per parameter, 60 to 90 of them per such statement — and keeps them while it stays
    the same."""
    raw, logged = conn.connection, conn.queries_logged
    held = getattr(_local, "cursor", None)
    if held is None or held[0] is not raw or held[1] != logged or raw is None:
        if conn.vendor == "postgresql":
            fresh = _prepared_cursor(conn)
        elif conn.vendor == "sqlite":
            fresh = _qmark_cursor(conn)
        else:
            fresh = None
        # Cursors of their own per text: only for PostgreSQL's prepared cursor.
        own: dict[str, Any] | None = (
            {} if fresh is not None and conn.vendor == "postgresql" else None
        )
        if fresh is None:
            fresh = conn.cursor()
        held = _local.cursor = (conn.connection, logged, fresh, own)
    if text is None or held[3] is None:
        return held[2]
    mine = held[3].get(text)
    if mine is None:
        if len(held[3]) >= _OWN_MAX:  # texts are few; never grow without end
            held[3].clear()
        mine = held[3][text] = _prepared_cursor(conn)
    return mine


_OWN_MAX = 32


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
    # Django registers its time-zone loader on each cursor it creates (psycopg_any's
    # register_tzloader, in DatabaseWrapper.create_cursor); a cursor made here without
    # conn.cursor() must do the same, or timestamps read through it come back in the wrong
    # zone.
    timestamptz = types["timestamptz"].oid
    loader = conn.connection.adapters.get_loader(timestamptz, Format.TEXT)
    if conn.timezone != getattr(loader, "timezone", conn.timezone):
        from django.db.backends.postgresql.psycopg_any import register_tzloader

        register_tzloader(conn.timezone, raw_cursor)
    # Django internals: `_prepare_cursor` is what conn.cursor() wraps a new driver cursor
    # with (CursorWrapper or CursorDebugWrapper, the hooks, the validation of the thread).
    return conn._prepare_cursor(raw_cursor)


def _prepared_cursor_class() -> Any:
    """Django internals: psycopg's server-binding cursor as Django's PostgreSQL backend
    subclasses it (its time-zone handling), made to prepare and to take PostgreSQL's own
    `$n` placeholders (psycopg's raw query cursor) — built on first use, so that importing
    this module does not import psycopg.

    Why raw: psycopg turns a text's `%s` into `$n` on every execute, from a cache only for
    texts of at most 50 parameters; a step's commit that carries a confirmation has ~60, and
    parsing its 2 KB text again cost ~0.3 ms per action (a tenth of the ledger's client
    CPU). The hot path's texts are few and fixed: each is numbered once here (`numbered`),
    Django's wrapper and its query log still see the `%s` text."""
    global _PreparedCursor
    if _PreparedCursor is None:
        from django.db.backends.postgresql.base import ServerBindingCursor
        from psycopg.raw_cursor import RawCursorMixin

        class PreparedCursor(RawCursorMixin, ServerBindingCursor):  # type: ignore[type-arg]
            prepare = True

            def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
                kwargs.setdefault("prepare", self.prepare)
                if params is not None:
                    query = numbered(query)
                # django-stubs declare ServerBindingCursor without its psycopg.Cursor base.
                return super().execute(query, params, **kwargs)  # type: ignore[misc]

            def send(self, query: Any, params: Any) -> Callable[[], None]:
                """`execute`, in two halves: this one sends the statement and returns as soon
                as its answer is awaited, the returned one waits for the answer and takes it
                in (after which the cursor is as `execute` leaves it). Until then the
                connection is busy: any other use of it fails loudly (libpq's "another command
                is already in progress"), it never mixes answers.

                psycopg internals: `_execute_gen` is the generator `execute` runs to its end;
                here it is run up to its first wait for the server's answer (`Wait.R`), and
                resumed from there. A statement prepared for the first time waits for the
                PREPARE's answer first: the statement is then sent only by the second half."""
                from psycopg.waiting import Wait

                work = self._execute_gen(numbered(query), params, prepare=self.prepare)
                waiting: list[Any] = []

                def until_answer() -> Any:
                    try:
                        state = next(work)
                        while state != Wait.R:
                            state = work.send((yield state))
                    except StopIteration:
                        return
                    waiting.append(state)

                with self._conn.lock:
                    self._conn.wait(until_answer())
                if not waiting:
                    return _done

                def answer() -> None:
                    # Interrupted (a signal's handler raised while it waited), it can be
                    # called again: it goes on from where the statement's generator stopped.
                    def resumed() -> Any:
                        try:
                            while True:
                                waiting[0] = work.send((yield waiting[0]))
                        except StopIteration:
                            return

                    with self._conn.lock:
                        self._conn.wait(resumed())

                return answer

        _PreparedCursor = PreparedCursor
    return _PreparedCursor


def _done() -> None:
    """The second half of a `send` whose statement was answered within the first."""


_PreparedCursor: Any = None
_NUMBERED: dict[str, str] = {}  # statement text with %s -> with $1, $2, … (str -> str)
_PLACEHOLDER = re.compile(r"%[s%]")


def numbered(query: str) -> str:
    """`query` with its `%s` placeholders as `$1`, `$2`, … and `%%` as `%` — what psycopg's
    own conversion sends for a text bound on the server. Any other `%` is refused, as
    psycopg refuses it: the texts here are the fast path's own."""
    converted = _NUMBERED.get(query)
    if converted is None:
        count = 0

        def one(match: re.Match[str]) -> str:
            nonlocal count
            if match.group() == "%%":
                return "%"
            count += 1
            return f"${count}"

        converted = _PLACEHOLDER.sub(one, query)
        if "%" in _PLACEHOLDER.sub("", query):
            raise ValueError(f"only %s and %% placeholders are supported: {query[:200]!r}")
        if len(_NUMBERED) >= _QMARK_MAX:  # shapes are few; never grow without end
            _NUMBERED.clear()
        _NUMBERED[query] = converted
    return converted


def _qmark_cursor(conn: Any) -> Any:
    """SQLite: Django's cursor, but it rewrites each statement's `%s` placeholders to `?`
    once, not on every execute. Django's SQLiteCursorWrapper runs a regular expression over
    the text of every statement it executes; the hot path executes the same few texts (each
    built once and cached: fastsql.statements) several times per step. The rewrite is
    Django's own `convert_query`, so the text sent is the same; and the cursor is still
    wrapped by `_prepare_cursor`, like `conn.cursor()`, so hooks and capture see it."""
    # Django internals: SQLiteCursorWrapper.convert_query is the one place Django turns
    # `%s` into `?`; the steps below are what DatabaseWrapper.create_cursor and
    # BaseDatabaseWrapper._cursor do around it.
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
