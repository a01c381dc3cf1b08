"""The executor's hot-path row writes, without the ORM's per-call query building.

A durable step is four statements (run CAS, checkpoint, stream head, journal entry). Built
through the QuerySet API each costs 0.2–0.7 ms of Python — cloning, resolving filters,
compiling — several times what the commit itself costs on SQLite: the reason a step cost
~10 raw commits (bench/). Here each statement *shape* is turned into SQL once, from the
model's own metadata, and cached; a call only adapts its values with the fields' own
`get_db_prep_save` / `get_db_prep_value` (what the ORM does before sending; plain str, int
and bool values, which those return unchanged, skip the call) and executes. The semantics
are the ORM's: the same columns and values, the same conditional `UPDATE … WHERE` with its
row count, the same database-clock expressions (compiled by Django's compiler), read values
run through the same converters. Statements go through Django's cursor, so query capture
and `execute_wrapper` see every one of them.

Only plain equality, `IN` and `IS NULL` conditions on one table — what a compare-and-swap or
a lookup by key needs. Anything else stays with the ORM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections, models
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import DateTimeField, ExpressionWrapper, F, Value
from django.db.models.functions import Now
from django.db.models.lookups import Exact
from django.db.models.sql import Query
from django.utils import timezone

from audit.journal import cursor as _cursor
from audit.journal import field_prep


@dataclass(frozen=True)
class DbNow:
    """The database clock plus `seconds`: lease and in-flight times are database time."""

    seconds: float = 0.0


NOW = DbNow()


@dataclass(frozen=True)
class Check:
    """A condition `(column + 0) = value`: the value is checked, but the planner is not offered
    the column's index (see `tenant_check`)."""

    value: Any


@dataclass(frozen=True)
class Add:
    """`column = column + amount`, evaluated by the database (like `F(column) + amount`)."""

    amount: int = 1


def tenant_check(tenant_id: int) -> Exact:
    """A QuerySet filter `tenant_id + 0 = tenant_id`: names the tenant in a query that already
    has a more selective key (a run, an action, a stream) without offering the planner the
    tenant's index. SQLite plans without statistics and, given `run_id = ? AND tenant_id = ?`,
    may walk all of a tenant's rows by its tenant index instead of one run's."""
    return Exact(F("tenant_id") + Value(0), tenant_id)


Prep = Callable[[Any, BaseDatabaseWrapper], Any]


def _preps(field: models.Field, vendor: str) -> tuple[Prep, Prep]:
    """(for saving, for a lookup) — the field's own functions, short-circuited for values
    they would return unchanged or adapt trivially (audit.journal.field_prep)."""

    def lookup(value: Any, conn: BaseDatabaseWrapper) -> Any:
        return field.get_db_prep_value(value, conn, prepared=False)

    return (
        field_prep(field, vendor, field.get_db_prep_save),
        field_prep(field, vendor, lookup),
    )


class _Table:
    """What the statements need of one model, computed once."""

    def __init__(self, model: type[models.Model], conn: BaseDatabaseWrapper) -> None:
        meta = model._meta
        qn = conn.ops.quote_name
        self.model = model
        self.name = qn(meta.db_table)
        self.fields = {f.attname: f for f in meta.concrete_fields}
        self.fields.update({f.name: f for f in meta.concrete_fields})
        self.column = {name: qn(f.column) for name, f in self.fields.items()}
        preps = {name: _preps(f, conn.vendor) for name, f in self.fields.items()}
        self.save = {name: save for name, (save, _) in preps.items()}
        self.lookup = {name: lookup for name, (_, lookup) in preps.items()}
        self.attnames = tuple(f.attname for f in meta.concrete_fields)
        self.insert_fields = [
            f for f in meta.concrete_fields if not isinstance(f, models.AutoField)
        ]
        self.inserts = [
            (
                f.attname,
                self.save[f.attname],
                f,
                bool(getattr(f, "auto_now", False) or getattr(f, "auto_now_add", False)),
            )
            for f in self.insert_fields
        ]
        self.sql: dict[tuple[Any, ...], str] = {}
        self.converters: dict[tuple[str, ...], list[tuple[int, list[Any], Any]]] = {}

    def convert(self, conn: BaseDatabaseWrapper, names: tuple[str, ...], rows: list[list[Any]]):
        """Run read values through the converters a QuerySet would apply."""
        plan = self.converters.get(names)
        if plan is None:
            plan = []
            for position, name in enumerate(names):
                column = self.fields[name].get_col(self.model._meta.db_table)
                convs = conn.ops.get_db_converters(column) + column.get_db_converters(conn)
                if convs:
                    plan.append((position, convs, column))
            self.converters[names] = plan
        for position, convs, column in plan:
            for row in rows:
                for convert in convs:
                    row[position] = convert(row[position], column, conn)
        return rows


_tables: dict[tuple[type[models.Model], str], _Table] = {}
_clocks: dict[tuple[str, DbNow], tuple[str, tuple[Any, ...]]] = {}


def _db() -> BaseDatabaseWrapper:
    return connections[DEFAULT_DB_ALIAS]


def _table(model: type[models.Model], conn: BaseDatabaseWrapper) -> _Table:
    found = _tables.get((model, conn.vendor))
    if found is None:
        found = _tables[(model, conn.vendor)] = _Table(model, conn)
    return found


def attnames(model: type[models.Model]) -> tuple[str, ...]:
    """Every concrete column's attname, in the model's order (what `from_db` expects)."""
    return _table(model, _db()).attnames


def _clock(model: type[models.Model], value: DbNow, conn: BaseDatabaseWrapper) -> Any:
    """SQL for `now() [+ seconds]`, compiled once per value by Django's own compiler."""
    found = _clocks.get((conn.vendor, value))
    if found is None:
        expression: Any = Now()
        if value.seconds:
            expression = ExpressionWrapper(
                Now() + Value(timedelta(seconds=value.seconds)), output_field=DateTimeField()
            )
        query = Query(model)
        compiler = query.get_compiler(connection=conn)
        resolved = expression.resolve_expression(query, allow_joins=False, for_save=True)
        sql, params = compiler.compile(resolved)
        found = _clocks[(conn.vendor, value)] = (sql, tuple(params))
    return found


def clock_sql(model: type[models.Model], value: DbNow = NOW) -> tuple[str, tuple[Any, ...]]:
    """(sql, params) of the database clock [+ seconds], as Django compiles it for `model`."""
    return _clock(model, value, _db())


def _where(
    table: _Table, where: Mapping[str, Any], conn: BaseDatabaseWrapper
) -> tuple[tuple[Any, ...], list[Any]]:
    """(shape, params) of an AND of equality / IN / IS NULL conditions."""
    shape: list[Any] = []
    params: list[Any] = []
    for name, value in where.items():
        prep = table.lookup[name]
        if value is None:
            shape.append((name, "null"))
        elif isinstance(value, Check):
            shape.append((name, "check"))
            params.append(prep(value.value, conn))
        elif isinstance(value, list | tuple | set | frozenset):
            shape.append((name, len(value)))
            params.extend(prep(v, conn) for v in value)
        else:
            shape.append((name, "="))
            params.append(prep(value, conn))
    return tuple(shape), params


def _where_sql(table: _Table, shape: tuple[Any, ...]) -> str:
    parts = []
    for name, kind in shape:
        column = table.column[name]
        if kind == "null":
            parts.append(f"{column} IS NULL")
        elif kind == "check":
            parts.append(f"({column} + 0) = %s")
        elif kind == "=":
            parts.append(f"{column} = %s")
        else:
            parts.append(f"{column} IN ({', '.join(['%s'] * kind)})")
    return " AND ".join(parts) or "1 = 1"


def _set(
    table: _Table, changes: Mapping[str, Any], conn: BaseDatabaseWrapper
) -> tuple[tuple[Any, ...], list[Any]]:
    """(shape, params) of a SET list: plain values, database-clock values, increments."""
    shape: list[Any] = []
    params: list[Any] = []
    for name, value in changes.items():
        if isinstance(value, DbNow):
            sql, clock_params = _clock(table.model, value, conn)
            shape.append((name, sql))
            params.extend(clock_params)
        elif isinstance(value, Add):
            shape.append((name, "+"))
            params.append(value.amount)
        elif hasattr(value, "resolve_expression"):
            raise TypeError(f"{name}: a Django expression; use statements.NOW/DbNow/Add")
        else:
            shape.append((name, ""))
            params.append(table.save[name](value, conn))
    return tuple(shape), params


def _update_sql(table: _Table, set_shape: tuple[Any, ...], where_shape: tuple[Any, ...]) -> str:
    assignments = []
    for name, kind in set_shape:
        column = table.column[name]
        if kind == "+":
            assignments.append(f"{column} = {column} + %s")
        else:
            assignments.append(f"{column} = {kind or '%s'}")
    return (
        f"UPDATE {table.name} SET {', '.join(assignments)} WHERE {_where_sql(table, where_shape)}"
    )


def _returns_rows(conn: BaseDatabaseWrapper) -> bool:
    """UPDATE … RETURNING: PostgreSQL; SQLite from 3.35 (Django 5.2 accepts 3.31)."""
    if conn.vendor == "sqlite":
        import sqlite3

        return sqlite3.sqlite_version_info >= (3, 35)
    return conn.vendor == "postgresql"


def update(
    model: type[models.Model],
    changes: Mapping[str, Any],
    where: Mapping[str, Any],
    *,
    returning: tuple[str, ...] = (),
) -> Any:
    """`UPDATE table SET … WHERE …`: the number of rows changed (the CAS result), or with
    `returning` (attnames) the changed rows' values, converted as a read converts them."""
    conn = _db()
    table = _table(model, conn)
    set_shape, params = _set(table, changes, conn)
    where_shape, where_params = _where(table, where, conn)
    inline = bool(returning) and _returns_rows(conn)
    key = ("update", set_shape, where_shape, returning, inline)
    sql = table.sql.get(key)
    if sql is None:
        sql = _update_sql(table, set_shape, where_shape)
        if inline:
            sql += f" RETURNING {', '.join(table.column[n] for n in returning)}"
        table.sql[key] = sql
    cursor = _cursor(conn)
    cursor.execute(sql, params + where_params)
    if not returning:
        return cursor.rowcount
    if inline:
        return table.convert(conn, returning, [list(row) for row in cursor.fetchall()])
    changed = cursor.rowcount
    if changed != 1:  # an older SQLite: read the one row back by its key
        return []
    pk = model._meta.pk.attname
    return select(model, returning, {pk: where[pk]})


def _insert_values(table: _Table, row: Mapping[str, Any], conn: BaseDatabaseWrapper) -> list:
    """Every insert column's value: as given (by attname), else what the ORM would use —
    now for auto_now / auto_now_add, else the field's default."""
    values = []
    for attname, prep, field, stamped in table.inserts:
        if attname in row:
            value = row[attname]
        elif stamped:
            value = timezone.now()
        else:
            value = field.get_default()
        values.append(prep(value, conn))
    return values


def insert(model: type[models.Model], rows: Iterable[Mapping[str, Any]]) -> None:
    """`INSERT INTO table (every concrete column) VALUES (…), (…)`."""
    conn = _db()
    table = _table(model, conn)
    params: list[Any] = []
    count = 0
    for row in rows:
        count += 1
        params.extend(_insert_values(table, row, conn))
    if not count:
        return
    key = ("insert", count)
    sql = table.sql.get(key)
    if sql is None:
        columns = ", ".join(table.column[f.attname] for f in table.insert_fields)
        values = f"({', '.join(['%s'] * len(table.insert_fields))})"
        sql = table.sql[key] = f"INSERT INTO {table.name} ({columns}) VALUES " + ", ".join(
            [values] * count
        )
    cursor = _cursor(conn)
    cursor.execute(sql, params)


def update_then_insert(
    model: type[models.Model],
    changes: Mapping[str, Any],
    where: Mapping[str, Any],
    insert_model: type[models.Model],
    row: Mapping[str, Any],
) -> bool:
    """`update(model, changes, where)`; only if it changed exactly one row, insert `row`.
    True if both happened. On PostgreSQL one statement (one round trip): the insert selects
    from the update's RETURNING."""
    conn = _db()
    if conn.vendor != "postgresql":
        if update(model, changes, where) != 1:
            return False
        insert(insert_model, [row])
        return True
    (_, changed, changed_params), (_, added, added_params) = update_then_insert_parts(
        model, changes, where, insert_model, row
    )
    cursor = _cursor(conn)
    cursor.execute(
        f"WITH changed AS ({changed} RETURNING 1) {added}", changed_params + added_params
    )
    return cursor.rowcount == 1


def update_then_insert_parts(
    model: type[models.Model],
    changes: Mapping[str, Any],
    where: Mapping[str, Any],
    insert_model: type[models.Model],
    row: Mapping[str, Any],
) -> list[tuple[str, str, list[Any]]]:
    """PostgreSQL: `update_then_insert` as the parts of a larger statement — ("changed",
    "UPDATE … WHERE …", params), whose WHERE the caller may extend (it ends the text), and
    ("inserted", "INSERT … SELECT … FROM changed", params)."""
    conn = _db()
    table, target = _table(model, conn), _table(insert_model, conn)
    set_shape, params = _set(table, changes, conn)
    where_shape, where_params = _where(table, where, conn)
    values = _insert_values(target, row, conn)
    key = ("update_then_insert", set_shape, where_shape, insert_model)
    sql = table.sql.get(key)
    if sql is None:
        columns = ", ".join(target.column[f.attname] for f in target.insert_fields)
        # In a SELECT the values need their column types spelled out (a NULL would be text).
        typed = ", ".join(f"%s::{f.db_type(conn)}" for f in target.insert_fields)
        sql = table.sql[key] = _update_sql(table, set_shape, where_shape)
        table.sql[key + ("insert",)] = (
            f"INSERT INTO {target.name} ({columns}) SELECT {typed} FROM changed"
        )
    return [
        ("changed", sql, params + where_params),
        ("inserted", table.sql[key + ("insert",)], values),
    ]


def select(
    model: type[models.Model],
    names: tuple[str, ...],
    where: Mapping[str, Any],
    *,
    for_update: bool = False,
    order_by: tuple[str, ...] = (),
) -> list[list[Any]]:
    """Rows of `names` (attnames) matching `where`, converted as the ORM converts them,
    ordered by `order_by` (attnames, ascending).

    `for_update` locks them (PostgreSQL `FOR UPDATE`; SQLite's write transaction already
    excludes every other writer)."""
    conn = _db()
    table = _table(model, conn)
    where_shape, params = _where(table, where, conn)
    lock = for_update and conn.features.has_select_for_update
    key = ("select", names, where_shape, lock, order_by)
    sql = table.sql.get(key)
    if sql is None:
        sql = (
            f"SELECT {', '.join(table.column[n] for n in names)} FROM {table.name} "
            f"WHERE {_where_sql(table, where_shape)}"
        )
        if order_by:
            sql += f" ORDER BY {', '.join(table.column[n] for n in order_by)}"
        if lock:
            sql += " FOR UPDATE"
        table.sql[key] = sql
    cursor = _cursor(conn)
    cursor.execute(sql, params)
    rows = [list(row) for row in cursor.fetchall()]
    return table.convert(conn, names, rows)


def load_all(
    model: type[models.Model],
    where: Mapping[str, Any],
    *,
    order_by: tuple[str, ...] = (),
) -> list[Any]:
    """Whole rows as model instances (as `.filter(**where).order_by(*order_by)` would)."""
    names = attnames(model)
    rows = select(model, names, where, order_by=order_by)
    return [model.from_db(DEFAULT_DB_ALIAS, list(names), row) for row in rows]


def load(
    model: type[models.Model],
    where: Mapping[str, Any],
    *,
    for_update: bool = False,
) -> models.Model | None:
    """One whole row as a model instance (as `.filter(**where).first()` would give it)."""
    names = attnames(model)
    rows = select(model, names, where, for_update=for_update)
    if not rows:
        return None
    return model.from_db(DEFAULT_DB_ALIAS, list(names), rows[0])
