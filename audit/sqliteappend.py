"""SQLite: a journal append inside a transaction as one statement instead of two.

Appending moves the stream's head by compare-and-swap (seq and hash) and inserts the entries;
on SQLite those were two statements in every transactional commit — two of the thirteen an
action sends (bench/HISTORY.md). PostgreSQL sends them as one (`fastsql.statements.
update_then_insert_rows`). SQLite has no data-modifying CTE, but an INSERT into a view runs
the view's INSTEAD OF trigger once per row, in order, inside that one statement: the trigger
moves the head from the entry's predecessor to the entry — the same condition the UPDATE
had, so the first row checks the head the caller expected and each later row the one before
it — and inserts the entry. When the head is not where the entry says it was, the trigger
fails the statement with `RAISE(ABORT, MOVED)`: SQLite undoes that statement, every row of
it, and nothing else — the caller's transaction goes on, and `audit.journal.write` takes the
locked head, as after a failed UPDATE.

What the view cannot give back is the new rows' ids: `last_insert_rowid()` reverts when a
trigger ends. The entries are left without one, as PostgreSQL's one-statement commit and the
SQLite step view (runtime.sqlitestep) leave theirs: nothing reads an appended entry's id from
memory (the id is the database's, read with the row).

Like the step view, the view and its trigger are not made by a migration (a trigger naming a
table stops SQLite's table rebuild halfway): runtime.sqlitestep drops them before every
`migrate` and makes them again after it. A database without them writes by two statements.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from django.db import IntegrityError, OperationalError
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Model

from audit.models import JournalEntry, StreamHead
from fastsql import statements
from fastsql.cursor import cursor

VIEW = "audit_journal_append"
TRIGGER = "audit_journal_append_write"
MOVED = "holdpoint: journal head moved"


def insert_columns(model: type[Model]) -> list[str]:
    """A model's columns in `statements.insert_values` order: what a view standing for its
    insert names (here and runtime.sqlitestep)."""
    return [str(f.column) for f in statements.insert_fields(model)]


def columns() -> list[str]:
    """The view's columns: the entry's, those `appending` writes."""
    return insert_columns(JournalEntry)


def appending(prefix: str = "") -> str:
    """A trigger's statements that append the entry in NEW's columns (each named `prefix` +
    the entry's column): the head moved from the entry's predecessor to it, else the whole
    statement fails (MOVED); then the entry inserted. This view's trigger, and the step
    view's (runtime.sqlitestep), whose entry columns are prefixed."""
    names, new = columns(), f"NEW.{prefix}"
    return f"""  UPDATE {StreamHead._meta.db_table} SET seq = {new}seq, hash = {new}hash
  WHERE stream = {new}stream AND tenant_id = {new}tenant_id AND seq = {new}seq - 1
    AND hash = {new}prev_hash;
  SELECT RAISE(ABORT, '{MOVED}') WHERE changes() = 0;
  INSERT INTO {JournalEntry._meta.db_table} ({", ".join(names)})
    VALUES ({", ".join(f"{new}{c}" for c in names)});"""


def _ddl() -> tuple[str, str]:
    view = f"CREATE VIEW {VIEW} AS SELECT " + ", ".join(f"NULL AS {c}" for c in columns())
    trigger = f"CREATE TRIGGER {TRIGGER} INSTEAD OF INSERT ON {VIEW} BEGIN\n{appending()}\nEND"
    return view, trigger


def install(connection: BaseDatabaseWrapper) -> None:
    """Make the view and its trigger (SQLite), from the models as they are."""
    make(connection, VIEW, (JournalEntry, StreamHead), _ddl)


def uninstall(connection: BaseDatabaseWrapper) -> None:
    """Drop the view (and with it its trigger)."""
    drop(connection, VIEW)


def installed(connection: BaseDatabaseWrapper) -> Mapping[str, str]:
    """The view's and the trigger's SQL as the database has them, by name (tests, checks)."""
    return found(connection, VIEW, TRIGGER)


# --- a view written through its trigger, made after `migrate` (here and runtime.sqlitestep) --


def make(
    connection: BaseDatabaseWrapper,
    view: str,
    models: Sequence[type[Model]],
    ddl: Callable[[], Sequence[str]],
) -> None:
    """SQLite: `view` made again from `ddl` — if the tables of `models` have every column
    their models name (a database migrated back to an older schema does not: it goes
    without, and its writers by the statements the view stands for)."""
    if connection.vendor != "sqlite":
        return
    drop(connection, view)
    with connection.cursor() as cur:
        for model in models:
            cur.execute(f"PRAGMA table_info({model._meta.db_table})")
            have = {row[1] for row in cur.fetchall()}
            if not {f.column for f in model._meta.concrete_fields} <= have:
                return
        for text in ddl():
            cur.execute(text)


def drop(connection: BaseDatabaseWrapper, view: str) -> None:
    """SQLite: `view` dropped, its triggers with it."""
    if connection.vendor != "sqlite":
        return
    with connection.cursor() as cur:
        cur.execute(f"DROP VIEW IF EXISTS {view}")


def found(connection: BaseDatabaseWrapper, *names: str) -> Mapping[str, str]:
    """The SQL of the schema objects `names` as the database has them, by name."""
    marks = ", ".join(["%s"] * len(names))
    with connection.cursor() as cur:
        cur.execute(f"SELECT name, sql FROM sqlite_master WHERE name IN ({marks})", list(names))  # noqa: S608
        return dict(cur.fetchall())


def write(conn: BaseDatabaseWrapper, rows: Sequence[Mapping[str, Any]]) -> bool | None:
    """Inside the caller's transaction: the entries' rows (`journal.chained`: the first
    chained onto the head the caller expects) as one INSERT into the view. True: written;
    False: the head was not where the rows say (nothing written, the transaction goes on);
    None: the view is not there (nothing written: the caller sends the two statements)."""
    params: list[Any] = []
    for row in rows:
        params += statements.insert_values(JournalEntry, row, conn)
    try:
        cursor(conn).execute(_insert_sql(len(rows)), params)
    except IntegrityError as exc:
        if MOVED in str(exc):
            return False
        raise
    except OperationalError as exc:
        if VIEW in str(exc):  # not installed (yet): see the module docstring
            return None
        raise
    return True


@functools.lru_cache(maxsize=8)
def _insert_sql(count: int) -> str:
    names = columns()
    one = f"({', '.join(['%s'] * len(names))})"
    return f"INSERT INTO {VIEW} ({', '.join(names)}) VALUES {', '.join([one] * count)}"
