"""SQLite: a step's commit as one statement, as it is on PostgreSQL.

A step's commit writes four rows — the run's compare-and-swap, the checkpoint, the run
stream's head and its journal entry — and on SQLite that was four statements inside
`BEGIN IMMEDIATE … COMMIT`, each through the driver and Django's cursor wrapper, where
PostgreSQL sends one (runtime.stepcommit). SQLite has no data-modifying CTE, but it runs a
view's INSTEAD OF trigger inside the INSERT that fires it: one INSERT into the view
`runtime_step_commit` writes all four rows in its own (autocommit, durable) transaction. The
trigger makes the same checks the statements made, in the same order, and fails the whole
INSERT — nothing written — when one does not hold:

- the run's row must still be where the commit expects it (fence, status, checkpoint rev,
  goal rev): else `RAISE(ABORT, 'holdpoint: run moved')` → the outcome "refused";
- the stream's head must still be the entry the new one is chained onto (seq and hash): else
  `RAISE(ABORT, 'holdpoint: journal head moved')` → "moved", and the caller writes the commit
  by its transaction from the locked head, as on PostgreSQL.

It covers the common commit: one journal entry, no ledger write, no new artifact, and run
columns among `SETTABLE`; anything else takes the transaction (`prepared` returns None).

The view and its trigger are not made by a migration: a trigger that names a table stops
SQLite's table rebuild (which Django's migrations use for most changes to a table) with "no
such table" halfway. So they are dropped before every `migrate` and made again after it from
the models as they are then (`install`, `uninstall`: runtime.apps) — their columns always
the tables' own. A database without them (another process migrating at that moment) gets
the transaction, never an error. The journal's own view for appends inside a transaction
(audit.sqliteappend) is made and dropped with them, for the same reason.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from django.db import IntegrityError, OperationalError, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from audit import journal, sqliteappend
from audit.models import JournalEntry, StreamHead
from fastsql import statements
from fastsql.cursor import cursor
from runtime.models import Checkpoint, Run

VIEW = "runtime_step_commit"
TRIGGER = "runtime_step_commit_write"
REFUSED = "holdpoint: run moved"
MOVED = sqliteappend.MOVED

# Run columns a commit through the view may set besides `checkpoint_rev` and `updated_at`
# (always set). NOT NULL columns: a NULL in the view's column keeps the row's value.
KEPT_IF_NULL = ("step_rev", "next_step", "status", "lease_owner", "consecutive_failures")
# `lease_expires_at` (nullable): `lease_set` 0 keeps it, 1 clears it, 2 sets it to the
# database's clock plus `lease_micros` — the expression the ORM writes for `DbNow(seconds)`.
SETTABLE = frozenset({"checkpoint_rev", "updated_at", "lease_expires_at", *KEPT_IF_NULL})
# Of those, written with lease_expires_at by a second UPDATE, only by a commit that sets one
# of them: SQLite rewrites an index's entry whenever an UPDATE names a column of it, changed
# or not, and status and lease_expires_at are the runs list's and the sweeper's indexes —
# two WAL pages more for a plain step that named them. The lease's owner goes with its
# expiry (a CHECK: both or neither), which each statement must leave true.
APART = ("status", "lease_owner")
_RUN = (
    "run_id",
    "tenant_id",
    "fence",
    "expect_status",
    "expect_rev",
    "goal_rev",
    "new_rev",
    *KEPT_IF_NULL,
    "lease_set",
    "lease_micros",
)
_NOW = "STRFTIME('%Y-%m-%d %H:%M:%f', 'NOW')"  # the ORM's Now() on SQLite


def columns() -> list[str]:
    """The view's columns, in the order `write` passes its values."""
    return [
        *_RUN,
        *(f"c_{c}" for c in sqliteappend.insert_columns(Checkpoint)),
        *(f"j_{c}" for c in sqliteappend.columns()),  # those `appending("j_")` writes
    ]


def _ddl() -> tuple[str, str]:
    checkpoint = sqliteappend.insert_columns(Checkpoint)
    view = f"CREATE VIEW {VIEW} AS SELECT " + ", ".join(f"NULL AS {c}" for c in columns())
    keep = ",\n    ".join(f"{c} = coalesce(NEW.{c}, {c})" for c in KEPT_IF_NULL if c not in APART)
    apart = "".join(f"{c} = coalesce(NEW.{c}, {c}),\n    " for c in APART)
    setting = " OR ".join(f"NEW.{c} IS NOT NULL" for c in APART)
    run = Run._meta.db_table
    trigger = f"""CREATE TRIGGER {TRIGGER} INSTEAD OF INSERT ON {VIEW} BEGIN
  UPDATE {run} SET checkpoint_rev = NEW.new_rev, updated_at = {_NOW},
    {keep}
  WHERE run_id = NEW.run_id AND tenant_id = NEW.tenant_id AND fence = NEW.fence
    AND status = NEW.expect_status AND checkpoint_rev = NEW.expect_rev
    AND goal_rev = NEW.goal_rev;
  SELECT RAISE(ABORT, '{REFUSED}') WHERE changes() = 0;
  UPDATE {run} SET {apart}lease_expires_at = CASE NEW.lease_set WHEN 0 THEN lease_expires_at
      WHEN 1 THEN NULL ELSE django_format_dtdelta('+', {_NOW}, NEW.lease_micros) END
  WHERE run_id = NEW.run_id AND tenant_id = NEW.tenant_id
    AND ({setting} OR NEW.lease_set <> 0);
  INSERT INTO {Checkpoint._meta.db_table} ({", ".join(checkpoint)})
    VALUES ({", ".join(f"NEW.c_{c}" for c in checkpoint)});
{sqliteappend.appending("j_")}
END"""
    return view, trigger


def install(connection: BaseDatabaseWrapper) -> None:
    """Make the view and its trigger (SQLite; after `migrate`), from the models as they are
    (a database whose tables lack a column they name goes without, by the transaction) —
    and the journal's own view for appends in a transaction (audit.sqliteappend)."""
    sqliteappend.install(connection)
    sqliteappend.make(connection, VIEW, (Run, Checkpoint, JournalEntry, StreamHead), _ddl)


def uninstall(connection: BaseDatabaseWrapper) -> None:
    """Drop both views and their triggers (SQLite; before `migrate`: see the module
    docstring)."""
    sqliteappend.uninstall(connection)
    sqliteappend.drop(connection, VIEW)


@contextmanager
def set_aside(connection: BaseDatabaseWrapper) -> Iterator[None]:
    """Without the view while the block runs, made again after it — for code that migrates
    with Django's MigrationExecutor itself, which sends neither pre_migrate nor post_migrate."""
    uninstall(connection)
    try:
        yield
    finally:
        install(connection)


def prepared(
    conn: BaseDatabaseWrapper,
    rows: tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]],
) -> list[Any] | None:
    """The run's and the checkpoint's values of the view's row for a commit (stepcommit's
    rows: the run's changes, its CAS, the checkpoint, the entry's payload) — or None when
    this commit cannot go through the view: asked before its journal entry is built."""
    update, mine, checkpoint, _ = rows
    if not update.keys() <= SETTABLE:
        return None
    if not isinstance(mine["status"], str):  # one status expected, not any of several
        return None
    lease = update.get("lease_expires_at", _KEEP)
    if lease is _KEEP:
        lease_set, micros = 0, None
    elif lease is None:
        lease_set, micros = 1, None
    elif isinstance(lease, statements.DbNow):
        lease_set, micros = 2, round(lease.seconds * 1_000_000)
    else:
        return None
    return [
        statements.key_value(Run, "run_id", mine["run_id"], conn),
        checkpoint["tenant_id"],
        mine["fence"],
        mine["status"],
        mine["checkpoint_rev"],
        mine["goal_rev"],
        update["checkpoint_rev"],
        *(update.get(name) for name in KEPT_IF_NULL),
        lease_set,
        micros,
        *statements.insert_values(Checkpoint, checkpoint, conn),
    ]


def write(
    conn: BaseDatabaseWrapper,
    stream: str,
    pending: list[JournalEntry],
    head: journal.Head,
    values: list[Any],
) -> str | None:
    """The commit (`prepared`'s values) and its one journal entry `pending[0]`, chained onto
    `head`, as one INSERT. Outside any transaction. Returns the outcome word of
    `journal.append_after` ("written", "refused", "moved"), or None when the view is not
    there (nothing written: the caller writes the commit by its transaction)."""
    (entry,) = journal.chained(head, pending)
    try:
        cursor(conn).execute(
            _insert_sql(), [*values, *statements.insert_values(JournalEntry, entry, conn)]
        )
    except IntegrityError as exc:
        said = str(exc)
        if REFUSED in said:
            return "refused"
        if MOVED in said:
            return "moved"
        raise
    except OperationalError as exc:
        if VIEW in str(exc):  # not installed (yet): see the module docstring
            return None
        raise
    return journal.appended(stream, pending, head)


class _Keep:
    pass


_KEEP = _Keep()


@functools.cache
def _insert_sql() -> str:
    names = columns()
    return f"INSERT INTO {VIEW} ({', '.join(names)}) VALUES ({', '.join(['%s'] * len(names))})"


def dropped_before_migrate(using: str = "default", **_: Any) -> None:
    """pre_migrate's receiver (runtime.apps): `uninstall`."""
    uninstall(connections[using])


def made_after_migrate(using: str = "default", **_: Any) -> None:
    """post_migrate's receiver (runtime.apps): `install`."""
    install(connections[using])


def installed(connection: BaseDatabaseWrapper) -> Mapping[str, str]:
    """The view's and the trigger's SQL as the database has them, by name (tests, checks)."""
    return sqliteappend.found(connection, VIEW, TRIGGER)
