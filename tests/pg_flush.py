"""The flush after a transactional test on PostgreSQL, made cheaper: the same end state.

Django flushes with one `TRUNCATE` of every table, and PostgreSQL's TRUNCATE costs per table
(new files for each): ~0.2 s a test, a sixth of the PostgreSQL suite, where SQLite's flush
takes 0.04 s. Most tables of a test are empty, and those that are not hold a few rows. So
this asks which tables hold rows (one query of EXISTS probes) and DELETEs from those only,
with `session_replication_role = replica` for the transaction (no foreign-key checks, and
the append-only triggers of the journal and checkpoints, which would refuse the DELETE,
stay out of the way, as they do for TRUNCATE). Every table is empty afterwards either way;
sequences are not reset, as before. Only for a superuser (who may set that role; CI's
`postgres` is one); otherwise Django's TRUNCATE. Installed by tests/conftest.py.
"""

from __future__ import annotations

from typing import Any


def install() -> None:
    from django.db.backends.postgresql.operations import DatabaseOperations

    full = DatabaseOperations.sql_flush
    if getattr(full, "holds_rows_only", False):
        return

    def sql_flush(
        self: DatabaseOperations,
        style: Any,
        tables: list[str],
        *,
        reset_sequences: bool = False,
        allow_cascade: bool = False,
    ) -> list[str]:
        if reset_sequences or not tables or not _superuser(self.connection):
            return full(
                self, style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade
            )
        probes = " UNION ALL ".join(
            f"(SELECT %s WHERE EXISTS (SELECT 1 FROM {self.quote_name(t)}))" for t in tables
        )
        with self.connection.cursor() as cursor:
            cursor.execute(probes, list(tables))
            held = [row[0] for row in cursor.fetchall()]
        if not held:
            return []
        return [
            "SET LOCAL session_replication_role = replica;",
            *(f"DELETE FROM {self.quote_name(t)};" for t in held),
        ]

    sql_flush.holds_rows_only = True  # type: ignore[attr-defined]
    DatabaseOperations.sql_flush = sql_flush  # type: ignore[method-assign]


_superusers: dict[str, bool] = {}


def _superuser(connection: Any) -> bool:
    name = connection.settings_dict["NAME"]
    if name not in _superusers:
        with connection.cursor() as cursor:
            cursor.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
            _superusers[name] = bool(cursor.fetchone()[0])
    return _superusers[name]
