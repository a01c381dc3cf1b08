"""How a model's table becomes SQL for fastsql.statements: the vocabulary a caller writes
conditions and changes in (NOW, Check, Above, Add, Elapsed, Part), what is computed once per
model and backend (`Table`: quoted names, value preparation, converters), and the SQL of the
condition and SET lists the statements share.

Apart from the statements so that each reads on its own: this is the per-model translation
(Django metadata and internals in, SQL text and shapes out), the statements are what is sent.
Callers use fastsql.statements, which names the vocabulary again; nothing else imports this.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from decimal import Decimal
from typing import Any, NamedTuple, TypeVar
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS, connections, models
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import DateTimeField, ExpressionWrapper, F, Value, signals
from django.db.models.base import ModelState
from django.db.models.functions import Now
from django.db.models.lookups import Exact
from django.db.models.sql import Query

from fastsql.prep import Prep, passes, save_and_lookup

_M = TypeVar("_M", bound=models.Model)


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
class Outer:
    """A condition `column = "<model's table>"."<name>"`: a subquery read along by a statement
    on `model` (statements.scalar, select's `reads`) tied to the row that statement reads —
    a stream head read with its run, say, only if it is the run's own tenant's."""

    model: type[models.Model]
    name: str

    def sql(self) -> str:
        column = self.model._meta.get_field(self.name).column  # type: ignore[union-attr]
        return f'"{self.model._meta.db_table}"."{column}"'


@dataclass(frozen=True)
class Above:
    """A condition `column > value`."""

    value: Any


@dataclass(frozen=True)
class Add:
    """`column = column + amount`, evaluated by the database (like `F(column) + amount`)."""

    amount: int = 1


@dataclass(frozen=True)
class Elapsed:
    """A column read as the database clock's verdict on it: `column IS NULL OR column < now`
    (`inclusive`: `<=`) — True when the time is unset or past. Lease and wake times are
    database time; comparing them in Python would use the application's clock."""

    name: str
    inclusive: bool = False


class Part(NamedTuple):
    """One statement of a larger one (`OneStatement`), named so that later parts can be made
    conditional on it (`after`). `writes`: a data-modifying statement, given `RETURNING 1`
    there, so that it yields a row per row it wrote; else a SELECT that yields its rows."""

    name: str
    sql: str
    params: list[Any]
    writes: bool = True


def tenant_check(tenant_id: int) -> Exact:
    """A QuerySet filter `tenant_id + 0 = tenant_id`: names the tenant in a query that already
    has a more selective key (a run, an action, a stream) without offering the planner the
    tenant's index. SQLite plans without statistics and, given `run_id = ? AND tenant_id = ?`,
    may walk all of a tenant's rows by its tenant index instead of one run's."""
    return Exact(F("tenant_id") + Value(0), tenant_id)


def insert_fields(model: type[models.Model]) -> list[models.Field[Any, Any]]:
    """The fields an insert writes, in its columns' order: every concrete one but an auto id."""
    return [f for f in model._meta.concrete_fields if not isinstance(f, models.AutoField)]


def _column(field: models.Field[Any, Any]) -> str:
    assert field.column is not None  # django-stubs: `str | None`; a concrete field has one
    return field.column


class Table:
    """What the statements need of one model, computed once."""

    def __init__(self, model: type[models.Model], conn: BaseDatabaseWrapper) -> None:
        meta = model._meta
        qn = conn.ops.quote_name
        self.model = model
        self.name = qn(meta.db_table)
        self.fields = {f.attname: f for f in meta.concrete_fields}
        self.fields.update({f.name: f for f in meta.concrete_fields})
        self.column = {name: qn(_column(f)) for name, f in self.fields.items()}
        preps = {name: save_and_lookup(f, conn.vendor) for name, f in self.fields.items()}
        self.save: dict[str, Prep] = {name: save for name, (save, _) in preps.items()}
        self.lookup: dict[str, Prep] = {name: lookup for name, (_, lookup) in preps.items()}
        self.attnames = tuple(f.attname for f in meta.concrete_fields)
        self.pk_column = qn(_column(meta.pk))
        self.insert_fields = insert_fields(model)
        # (attname, the class its prep returns unchanged — fastsql.prep.passes —, the prep,
        # the field, whether it is stamped with the time), for each column an insert writes.
        self.inserts = [
            (
                f.attname,
                passes(self.save[f.attname]),
                self.save[f.attname],
                f,
                bool(getattr(f, "auto_now", False) or getattr(f, "auto_now_add", False)),
            )
            for f in self.insert_fields
        ]
        self.insert_names = frozenset(f.attname for f in self.insert_fields)
        self.insert_preps = [(attname, kind, prep) for attname, kind, prep, _, _ in self.inserts]
        self.insert_columns = ", ".join(self.column[f.attname] for f in self.insert_fields)
        # In a SELECT the values need their column types spelled out (a NULL would be text).
        self.typed_slots = tuple(f"%s::{f.db_type(conn)}" for f in self.insert_fields)
        self.sql: dict[tuple[Any, ...], str] = {}
        self.converters: dict[tuple[Any, ...], list[tuple[int, list[Any], Any]]] = {}

    def convert(
        self, conn: BaseDatabaseWrapper, names: tuple[Any, ...], rows: list[list[Any]]
    ) -> list[list[Any]]:
        """Run read values through the converters a QuerySet would apply (an `Elapsed`
        column: to bool, as a boolean expression of the ORM's would be; a `DbNow`: as the
        ORM's `Now()` is read)."""
        plan = self.converters.get(names)
        if plan is None:
            plan = []
            for position, name in enumerate(names):
                if isinstance(name, Elapsed):
                    plan.append((position, [_to_bool], None))
                    continue
                if isinstance(name, DbNow):  # read as the ORM reads its own clock, Now()
                    clock = Now()
                    convs = conn.ops.get_db_converters(clock) + clock.get_db_converters(conn)
                    if convs:
                        plan.append((position, convs, clock))
                    continue
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


def _to_bool(value: Any, expression: Any, conn: BaseDatabaseWrapper) -> bool:
    return bool(value)  # SQLite answers 0/1


_tables: dict[tuple[type[models.Model], str], Table] = {}
_clocks: dict[tuple[str, DbNow], tuple[str, tuple[Any, ...]]] = {}


def db() -> BaseDatabaseWrapper:
    return connections[DEFAULT_DB_ALIAS]


def table_of(model: type[models.Model], conn: BaseDatabaseWrapper) -> Table:
    found = _tables.get((model, conn.vendor))
    if found is None:
        found = _tables[(model, conn.vendor)] = Table(model, conn)
    return found


def attnames(model: type[models.Model]) -> tuple[str, ...]:
    """Every concrete column's attname, in the model's order (what `from_db` expects)."""
    return table_of(model, db()).attnames


def built(model: type[_M], values: Mapping[str, Any]) -> _M:
    """`model(**values)`, the instance a writer builds before it inserts the row — each
    column not in `values` takes its field's default, as Model.__init__ gives it — without
    __init__'s pass over the fields (4% of an action's client CPU in a profile: an action
    builds one Action and five journal entries). A name that is no column is refused, as
    __init__ refuses it. When something listens to the model's pre_init or post_init signal,
    its __init__ runs all the same."""
    if (signals.pre_init.receivers or signals.post_init.receivers) and (
        signals.pre_init.has_listeners(model) or signals.post_init.has_listeners(model)
    ):  # (no receiver at all, the usual case: not asked per model)
        return model(**values)
    instance = model.__new__(model)
    instance._state = ModelState()
    data = instance.__dict__
    given = 0
    for name, default in _column_defaults(model):
        if name in values:
            data[name] = values[name]
            given += 1
        else:
            data[name] = default()
    if given != len(values):
        unknown = sorted(set(values) - set(data))
        raise TypeError(f"{model.__name__}: no column named {', '.join(unknown)}")
    return instance


_defaults: dict[type[models.Model], tuple[tuple[str, Callable[[], Any]], ...]] = {}


def _column_defaults(model: type[models.Model]) -> tuple[tuple[str, Callable[[], Any]], ...]:
    """Each concrete column's attname and what gives its default: the field's get_default,
    or — where that is Field's own, which only calls it — the callable it calls (Django
    internals: `Field._get_default`, computed once per field)."""
    found = _defaults.get(model)
    if found is None:
        found = _defaults[model] = tuple(
            (
                field.attname,
                field._get_default  # type: ignore[attr-defined]
                if type(field).get_default is models.Field.get_default
                else field.get_default,
            )
            for field in model._meta.concrete_fields
        )
    return found


def clock_sql(model: type[models.Model], value: DbNow, conn: BaseDatabaseWrapper) -> Any:
    """SQL for `now() [+ seconds]`, compiled once per value by Django's own compiler."""
    # Django internals: a bare sql.Query and its compiler, the way QuerySet.update compiles
    # an expression for the SET list — so the clock is exactly the ORM's on each backend.
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


# Values recognised by their class alone as plain values — neither a condition's special form
# nor an expression — so that the common case costs one set lookup, not three isinstance calls
# (this runs for every column of every statement of every step).
_PLAIN = frozenset({str, int, bool, float, Decimal, datetime, date, UUID})
_COLLECTIONS = (list, tuple, set, frozenset)


def conditions(
    table: Table, where: Mapping[str, Any], conn: BaseDatabaseWrapper
) -> tuple[tuple[Any, ...], list[Any]]:
    """(shape, params) of an AND of equality / IN / IS NULL conditions (and `Outer` ones)."""
    shape: list[Any] = []
    params: list[Any] = []
    for name, value in where.items():
        prep = table.lookup[name]
        if value.__class__ in _PLAIN:
            shape.append((name, "="))
            params.append(prep(value, conn))
        elif value is None:
            shape.append((name, "null"))
        elif isinstance(value, Check):
            shape.append((name, "check"))
            params.append(prep(value.value, conn))
        elif isinstance(value, Above):
            shape.append((name, "above"))
            params.append(prep(value.value, conn))
        elif isinstance(value, Outer):
            shape.append((name, value))
        elif isinstance(value, _COLLECTIONS):
            shape.append((name, len(value)))
            params.extend(prep(v, conn) for v in value)
        else:
            shape.append((name, "="))
            params.append(prep(value, conn))
    return tuple(shape), params


def conditions_sql(table: Table, shape: tuple[Any, ...], after: tuple[str, ...] = ()) -> str:
    """The conditions of `shape`; with `after`, also that each of those parts wrote a row."""
    parts = []
    for name, kind in shape:
        column = table.column[name]
        if kind == "null":
            parts.append(f"{column} IS NULL")
        elif kind == "check":
            parts.append(f"({column} + 0) = %s")
        elif kind == "above":
            parts.append(f"{column} > %s")
        elif kind == "=":
            parts.append(f"{column} = %s")
        elif isinstance(kind, Outer):
            parts.append(f"{column} = {kind.sql()}")
        else:
            parts.append(f"{column} IN ({', '.join(['%s'] * kind)})")
    parts += [f"EXISTS (SELECT 1 FROM {name})" for name in after]
    return " AND ".join(parts) or "1 = 1"


def assignments(
    table: Table, changes: Mapping[str, Any], conn: BaseDatabaseWrapper
) -> tuple[tuple[Any, ...], list[Any]]:
    """(shape, params) of a SET list: plain values, database-clock values, increments."""
    shape: list[Any] = []
    params: list[Any] = []
    for name, value in changes.items():
        if value is None or value.__class__ in _PLAIN:
            shape.append((name, ""))
            params.append(table.save[name](value, conn))
        elif isinstance(value, DbNow):
            sql, clock_params = clock_sql(table.model, value, conn)
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


def update_sql(
    table: Table,
    set_shape: tuple[Any, ...],
    where_shape: tuple[Any, ...],
    after: tuple[str, ...] = (),
) -> str:
    assignments = []
    for name, kind in set_shape:
        column = table.column[name]
        if kind == "+":
            assignments.append(f"{column} = {column} + %s")
        else:
            assignments.append(f"{column} = {kind or '%s'}")
    where = conditions_sql(table, where_shape, after)
    return f"UPDATE {table.name} SET {', '.join(assignments)} WHERE {where}"


def returns_rows(conn: BaseDatabaseWrapper) -> bool:
    """UPDATE … RETURNING: PostgreSQL; SQLite from 3.35 (Django 5.2 accepts 3.31)."""
    if conn.vendor == "sqlite":
        import sqlite3

        return sqlite3.sqlite_version_info >= (3, 35)
    return conn.vendor == "postgresql"
