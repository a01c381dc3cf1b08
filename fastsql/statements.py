"""The hot path's statements, each shape turned into SQL once, without the ORM's per-call cost.

A durable step is four statements (run CAS, checkpoint, stream head, journal entry). Built
through the QuerySet API each costs 0.2–0.7 ms of Python — cloning, resolving filters,
compiling — several times what the commit itself costs on SQLite: the reason a step cost
~10 raw commits (bench/). Here each statement *shape* is turned into SQL once, from the
model's own metadata, and cached; a call only adapts its values with the fields' own
`get_db_prep_save` / `get_db_prep_value` (fastsql.prep) and executes. The semantics are the
ORM's: the same columns and values, the same conditional `UPDATE … WHERE` with its row
count, the same database-clock expressions (compiled by Django's compiler), read values run
through the same converters. Statements go through Django's cursor (fastsql.cursor), so query
capture and `execute_wrapper` see every one of them.

Only plain equality, `IN` and `IS NULL` conditions on one table — what a compare-and-swap or
a lookup by key needs. Anything else stays with the ORM.

On PostgreSQL several of these can be sent as *one* statement (`OneStatement`: `WITH … AS
(… RETURNING 1)`), each part conditional on the parts it needs to have written — one round
trip and one implicit transaction where BEGIN, the statements and COMMIT would be several.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.db import DEFAULT_DB_ALIAS, DataError, connections, models
from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils import timezone

from fastsql.cursor import cursor as _cursor
from fastsql.tables import (
    NOW,
    Above,
    Add,
    Check,
    DbNow,
    Elapsed,
    Outer,
    Part,
    Table,
    assignments,
    attnames,
    built,
    clock_sql,
    conditions,
    conditions_sql,
    db,
    insert_fields,
    returns_rows,
    table_of,
    tenant_check,
    update_sql,
)

# What callers use; the vocabulary of fastsql.tables is named again here, so a caller writes
# `statements.NOW` or `statements.Check(...)` beside the statements themselves.
__all__ = [
    "NOW",
    "Above",
    "Add",
    "Check",
    "DbNow",
    "Elapsed",
    "OneStatement",
    "Outer",
    "Part",
    "PartsAfter",
    "Read",
    "attnames",
    "built",
    "insert",
    "insert_fields",
    "insert_values",
    "key_value",
    "load",
    "load_all",
    "select",
    "scalar",
    "sends",
    "tenant_check",
    "update",
    "update_then_insert",
    "update_then_insert_parts",
    "update_then_insert_rows",
]


def update(
    model: type[models.Model],
    changes: Mapping[str, Any],
    where: Mapping[str, Any],
    *,
    returning: tuple[str, ...] = (),
) -> Any:
    """`UPDATE table SET … WHERE …`: the number of rows changed (the CAS result), or with
    `returning` (attnames) the changed rows' values, converted as a read converts them."""
    return _update(db(), model, changes, where, returning)


def _update(
    conn: BaseDatabaseWrapper,
    model: type[models.Model],
    changes: Mapping[str, Any],
    where: Mapping[str, Any],
    returning: tuple[str, ...] = (),
) -> Any:
    table = table_of(model, conn)
    set_shape, params = assignments(table, changes, conn)
    where_shape, where_params = conditions(table, where, conn)
    inline = bool(returning) and returns_rows(conn)
    key = ("update", set_shape, where_shape, returning, inline)
    sql = table.sql.get(key)
    if sql is None:
        sql = update_sql(table, set_shape, where_shape)
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


def _insert_values(table: Table, row: Mapping[str, Any], conn: BaseDatabaseWrapper) -> list[Any]:
    """Every insert column's value: as given (by attname), else what the ORM would use —
    now for auto_now / auto_now_add, else the field's default. A `DbNow` is kept as it is:
    `_insert` writes the database clock in its place."""
    if row.keys() >= table.insert_names:  # all given (an instance's __dict__): the short way
        # No call for a value its prep would return as it is (fastsql.prep.passes) nor for a
        # clock: this runs for every column of every row a step inserts.
        return [
            value
            if (cls := (value := row[name]).__class__) is kind or cls is DbNow
            else prep(value, conn)
            for name, kind, prep in table.insert_preps
        ]
    values = []
    for attname, kind, prep, field, stamped in table.inserts:
        if attname in row:
            value = row[attname]
        elif stamped:
            value = timezone.now()
        else:
            value = field.get_default()
        cls = value.__class__  # as above
        values.append(value if cls is kind or cls is DbNow else prep(value, conn))
    return values


def insert_values(
    model: type[models.Model], row: Mapping[str, Any], conn: BaseDatabaseWrapper
) -> list[Any]:
    """The values `insert` would send for `row`, in `insert_fields` order — for a writer
    that sends them in a statement of its own (runtime.sqlitestep). No `DbNow` in `row`."""
    return _insert_values(table_of(model, conn), row, conn)


def key_value(model: type[models.Model], name: str, value: Any, conn: BaseDatabaseWrapper) -> Any:
    """`value` as a condition on column `name` sends it (a UUID as SQLite stores it, …)."""
    return table_of(model, conn).lookup[name](value, conn)


def _with_clocks(
    table: Table, conn: BaseDatabaseWrapper, params: list[Any]
) -> tuple[tuple[tuple[int, DbNow], ...], list[Any]]:
    """The positions of the `DbNow` values among an insert's `params`, and the params with
    each replaced by its clock's own parameters (none, or its interval)."""
    clocks = tuple([(i, v) for i, v in enumerate(params) if v.__class__ is DbNow])
    if not clocks:
        return (), params
    spliced = list(params)
    for position, value in reversed(clocks):  # from the last: the earlier positions hold
        spliced[position : position + 1] = clock_sql(table.model, value, conn)[1]
    return clocks, spliced


def _values_sql(
    table: Table, conn: BaseDatabaseWrapper, count: int, clocks: tuple[tuple[int, DbNow], ...]
) -> str:
    """`(%s, …), (%s, …)` for `count` rows, the clock's SQL where a `DbNow` stands."""
    width = len(table.insert_fields)
    slots = ["%s"] * (width * count)
    for position, value in clocks:
        slots[position] = clock_sql(table.model, value, conn)[0]
    return ", ".join(
        f"({', '.join(slots[row * width : (row + 1) * width])})" for row in range(count)
    )


def _rows_values(
    table: Table, rows: Iterable[Mapping[str, Any]], conn: BaseDatabaseWrapper
) -> tuple[int, list[Any]]:
    count, params = 0, []
    for row in rows:
        count += 1
        params.extend(_insert_values(table, row, conn))
    return count, params


def insert(
    model: type[models.Model],
    rows: Iterable[Mapping[str, Any]],
    *,
    pks: bool = False,
    returning: tuple[str, ...] = (),
) -> list[Any]:
    """`INSERT INTO table (every concrete column but an auto id) VALUES (…), (…)`. `rows` map
    attnames to values (an instance's `__dict__` will do); a value may be `NOW` / `DbNow`, the
    database clock. With `pks` (a table with an auto id) returns the new rows' ids in order;
    with `returning` (attnames; one row, a table whose key is given) the row's values as
    stored, converted as a read converts them — what a database-clock value became; else
    []."""
    if returning:
        return _insert_returning(db(), model, list(rows), returning)
    return _insert(db(), model, rows, pks)


def _insert_sql(
    table: Table, conn: BaseDatabaseWrapper, count: int, clocks: tuple[Any, ...], tail: str
) -> str:
    key = ("insert", count, tail, clocks)
    sql = table.sql.get(key)
    if sql is None:
        values = _values_sql(table, conn, count, clocks)
        sql = f"INSERT INTO {table.name} ({table.insert_columns}) VALUES {values}{tail}"
        table.sql[key] = sql
    return sql


def _insert_returning(
    conn: BaseDatabaseWrapper,
    model: type[models.Model],
    rows: list[Mapping[str, Any]],
    returning: tuple[str, ...],
) -> list[Any]:
    if len(rows) != 1:
        raise ValueError("insert(returning=…) takes exactly one row")
    table = table_of(model, conn)
    _, params = _rows_values(table, rows, conn)
    clocks, params = _with_clocks(table, conn, params)
    inline = returns_rows(conn)
    tail = f" RETURNING {', '.join(table.column[n] for n in returning)}" if inline else ""
    cursor = _cursor(conn)
    cursor.execute(_insert_sql(table, conn, 1, clocks, tail), params)
    if inline:
        return table.convert(conn, returning, [list(row) for row in cursor.fetchall()])
    pk = model._meta.pk.attname  # an older SQLite: read the row back by its key
    return select(model, returning, {pk: rows[0][pk]})


def _insert(
    conn: BaseDatabaseWrapper,
    model: type[models.Model],
    rows: Iterable[Mapping[str, Any]],
    pks: bool = False,
) -> list[Any]:
    table = table_of(model, conn)
    count, params = _rows_values(table, rows, conn)
    if not count:
        return []
    clocks, params = _with_clocks(table, conn, params)
    inline = pks and conn.vendor == "postgresql"
    tail = f" RETURNING {table.pk_column}" if inline else ""
    cursor = _cursor(conn)
    cursor.execute(_insert_sql(table, conn, count, clocks, tail), params)
    if not pks:
        return []
    if inline:
        return [row[0] for row in cursor.fetchall()]
    if conn.vendor != "sqlite":
        raise NotImplementedError(f"the new ids of a multi-row insert on {conn.vendor}")
    # One statement under SQLite's single writer lock: its rows took consecutive rowids.
    first = cursor.lastrowid - count + 1
    return list(range(first, first + count))


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
    conn = db()
    if conn.vendor != "postgresql":
        if _update(conn, model, changes, where) != 1:
            return False
        _insert(conn, insert_model, [row])
        return True
    changed, added = _update_then_insert_parts(conn, model, changes, where, insert_model, [row])
    cursor = _cursor(conn)
    cursor.execute(
        f"WITH {changed.name} AS ({changed.sql} RETURNING 1) {added.sql}",
        changed.params + added.params,
    )
    written: int = cursor.rowcount
    return written == 1


def update_then_insert_rows(
    model: type[models.Model],
    changes: Mapping[str, Any],
    where: Mapping[str, Any],
    insert_model: type[models.Model],
    rows: Sequence[Mapping[str, Any]],
) -> list[Any] | None:
    """`update_then_insert` of several rows into a table with an auto id: the new rows'
    primary keys in order, or None (nothing inserted) if the update did not change exactly
    one row. On PostgreSQL one statement."""
    conn = db()
    if conn.vendor != "postgresql":
        if _update(conn, model, changes, where) != 1:
            return None
        return _insert(conn, insert_model, rows, pks=True)
    changed, added = _update_then_insert_parts(conn, model, changes, where, insert_model, rows)
    cursor = _cursor(conn)
    cursor.execute(
        f"WITH {changed.name} AS ({changed.sql} RETURNING 1) {added.sql}"
        f" RETURNING {table_of(insert_model, conn).pk_column}",
        changed.params + added.params,
    )
    return [row[0] for row in cursor.fetchall()] or None


def update_then_insert_parts(
    model: type[models.Model],
    changes: Mapping[str, Any],
    where: Mapping[str, Any],
    insert_model: type[models.Model],
    row: Mapping[str, Any],
) -> list[Part]:
    """PostgreSQL: `update_then_insert` as the parts of a larger statement (`OneStatement`) —
    ("changed", "UPDATE … WHERE …", params) and ("inserted", "INSERT … SELECT … FROM changed",
    params)."""
    return _update_then_insert_parts(db(), model, changes, where, insert_model, [row])


def _update_then_insert_parts(
    conn: BaseDatabaseWrapper,
    model: type[models.Model],
    changes: Mapping[str, Any],
    where: Mapping[str, Any],
    insert_model: type[models.Model],
    rows: Sequence[Mapping[str, Any]],
) -> list[Part]:
    return [
        _update_part(conn, "changed", model, changes, where, ()),
        _insert_part(conn, "inserted", insert_model, rows, "changed"),
    ]


class OneStatement:
    """PostgreSQL, outside any transaction: parts — each an UPDATE, a locking SELECT or an
    INSERT, and each conditional on earlier parts having written (`after`) — run as *one*
    statement (`WITH` each part `RETURNING 1`): one round trip, its own implicit transaction,
    where BEGIN, the statements and COMMIT would be several. All of it is written or none.

    The parts of one statement must touch different rows: PostgreSQL runs them on one
    snapshot, and a row changed by one part is invisible to the others."""

    def __init__(self) -> None:
        self.conn = db()  # looked up once: each lookup costs more than building a part
        if self.conn.vendor != "postgresql" or self.conn.in_atomic_block:
            raise RuntimeError("OneStatement is one autocommit statement on PostgreSQL")
        self.reads: list[Read] = []

    def read(self, model: type[models.Model], column: str, where: Mapping[str, Any]) -> Read:
        """A value the statement also reads, in its own snapshot, and returns: the `column`
        of the first row of `model` matching `where`. Its `Read` is filled in by `run` when
        the statement wrote (`done`; `value` None without a matching row)."""
        found = scalar(model, column, where, self.conn)
        self.reads.append(found)
        return found

    def update(
        self,
        name: str,
        model: type[models.Model],
        changes: Mapping[str, Any],
        where: Mapping[str, Any],
        *,
        after: tuple[str, ...] = (),
    ) -> Part:
        """`UPDATE … WHERE …`, also conditional on each part in `after` having written."""
        return _update_part(self.conn, name, model, changes, where, after)

    def lock(
        self,
        name: str,
        model: type[models.Model],
        where: Mapping[str, Any],
        *,
        after: tuple[str, ...],
    ) -> Part:
        """`SELECT 1 … WHERE … FOR UPDATE`, once each part in `after` has written: locks the
        rows found and yields one row for each."""
        return _lock_part(self.conn, name, model, where, after)

    def insert(
        self, name: str, model: type[models.Model], rows: Sequence[Mapping[str, Any]], *, after: str
    ) -> Part:
        """`INSERT … SELECT` of `rows`, once per row the part `after` wrote: nothing if it
        wrote none (each part's rows here come from a one-row update: once)."""
        return _insert_part(self.conn, name, model, rows, after)

    def absent(
        self, name: str, model: type[models.Model], where: Mapping[str, Any], *, after: str
    ) -> Part:
        """`SELECT 1 FROM after WHERE NOT EXISTS (SELECT 1 FROM table WHERE …)`: a row for
        each row of the part `after` while no row of `model` matches `where` — a guard that
        the parts after it (and the statement's last) write only if nothing matched, read in
        the statement's own snapshot."""
        table = table_of(model, self.conn)
        where_shape, params = conditions(table, where, self.conn)
        key = ("absent_part", where_shape, after)
        sql = table.sql.get(key)
        if sql is None:
            where_sql = conditions_sql(table, where_shape)
            sql = table.sql[key] = (
                f"SELECT 1 FROM {after} WHERE NOT EXISTS"
                f" (SELECT 1 FROM {table.name} WHERE {where_sql})"
            )
        return Part(name, sql, params, writes=False)

    def run(self, parts: Sequence[Part]) -> tuple[int, int] | None:
        """Run `parts`, in order, as one statement. Returns (rows the first part wrote, rows
        the last part wrote); (0, 0) when the first wrote none, and the parts conditional on
        it then wrote none either. None when the first wrote and the last did not: the
        statement then fails on purpose (a division by zero) and rolls back whole, so
        nothing of it is written."""
        sql, params = self._statement(parts)
        cursor = _cursor(self.conn, sql)
        try:
            cursor.execute(sql, params)
        except DataError:  # the deliberate failure: nothing was written
            return None
        return self._counts(cursor)

    def send(self, parts: Sequence[Part]) -> Callable[[], tuple[int, int] | None]:
        """`run`, in two halves (PostgreSQL's prepared cursor; `sends()` says when): the
        statement is sent now — autocommit, so it commits on its own as soon as the server
        has run it — and the returned function waits for its answer and returns what `run`
        would. Until that function is called the connection must not be used."""
        sql, params = self._statement(parts)
        cursor = _cursor(self.conn, sql)
        with self.conn.wrap_database_errors:
            answer = cursor.cursor.send(sql, params)

        def counts() -> tuple[int, int] | None:
            try:
                with self.conn.wrap_database_errors:
                    answer()
            except DataError:  # the deliberate failure: nothing was written
                return None
            return self._counts(cursor)

        return counts

    def _statement(self, parts: Sequence[Part]) -> tuple[str, list[Any]]:
        reads = self.reads
        key = (*((part.name, part.sql) for part in parts), *(read.sql for read in reads))
        sql = _CHAINS.get(key)
        if sql is None:
            first, last = parts[0].name, parts[-1].name
            sql = _CHAINS[key] = (
                "WITH "
                + ", ".join(
                    f"{part.name} AS ({part.sql}{' RETURNING 1' if part.writes else ''})"
                    for part in parts
                )
                + f" SELECT (SELECT count(*) FROM {first}), (SELECT count(*) FROM {last})"
                + f", CASE WHEN (SELECT count(*) FROM {first}) > 0"
                f" THEN 1 / (SELECT count(*) FROM {last}) END"
                + "".join(f", {read.sql}" for read in reads)
            )
        params = [value for part in parts for value in part.params]
        for read in reads:
            params += read.params
        return sql, params

    def _counts(self, cursor: Any) -> tuple[int, int]:
        first_count, last_count, _, *values = cursor.fetchone()
        if first_count and last_count:
            for read, value in zip(self.reads, values, strict=True):
                read.value, read.done = value, True
        return first_count, last_count


_CHAINS: dict[tuple[Any, ...], str] = {}


def sends(conn: BaseDatabaseWrapper | None = None) -> bool:
    """Whether `OneStatement.send` can split a statement on this connection: PostgreSQL's
    prepared cursor, with nobody watching the statements (Django's query log and
    `execute_wrapper` hooks see only what goes through Django's cursor, and `send` does not)."""
    conn = conn or connections[DEFAULT_DB_ALIAS]
    if conn.vendor != "postgresql" or conn.queries_logged or conn.execute_wrappers:
        return False
    return hasattr(_cursor(conn).cursor, "send")


@dataclass
class Read:
    """A value read along by another statement — a `OneStatement` (`OneStatement.read`) or a
    `select` (its `reads`) — as a scalar subquery (`scalar`). Its value is as the driver
    gives it: no field's converter runs (read plain columns: numbers, text)."""

    sql: str
    params: list[Any]
    value: Any = None
    done: bool = False


def scalar(
    model: type[models.Model],
    column: str,
    where: Mapping[str, Any],
    conn: BaseDatabaseWrapper | None = None,
) -> Read:
    """`(SELECT column FROM table WHERE … LIMIT 1)`, to be read along by another statement:
    the `column` of the first row of `model` matching `where` (None without one)."""
    conn = conn or db()
    table = table_of(model, conn)
    where_shape, params = conditions(table, where, conn)
    key = ("read", column, where_shape)
    sql = table.sql.get(key)
    if sql is None:
        sql = table.sql[key] = (
            f"(SELECT {table.column[column]} FROM {table.name}"
            f" WHERE {conditions_sql(table, where_shape)} LIMIT 1)"
        )
    return Read(sql, params)


# Writes offered as parts of a larger `OneStatement`: given the statement and the name of the
# part they follow, their parts — or None: not this time (the caller writes them otherwise).
PartsAfter = Callable[[OneStatement, str], list[Part] | None]


def _update_part(
    conn: BaseDatabaseWrapper,
    name: str,
    model: type[models.Model],
    changes: Mapping[str, Any],
    where: Mapping[str, Any],
    after: tuple[str, ...],
) -> Part:
    table = table_of(model, conn)
    set_shape, params = assignments(table, changes, conn)
    where_shape, where_params = conditions(table, where, conn)
    key = ("update_part", set_shape, where_shape, after)
    sql = table.sql.get(key)
    if sql is None:
        sql = table.sql[key] = update_sql(table, set_shape, where_shape, after)
    return Part(name, sql, params + where_params)


def _lock_part(
    conn: BaseDatabaseWrapper,
    name: str,
    model: type[models.Model],
    where: Mapping[str, Any],
    after: tuple[str, ...],
) -> Part:
    table = table_of(model, conn)
    where_shape, params = conditions(table, where, conn)
    key = ("lock_part", where_shape, after)
    sql = table.sql.get(key)
    if sql is None:
        where_sql = conditions_sql(table, where_shape, after)
        sql = table.sql[key] = f"SELECT 1 FROM {table.name} WHERE {where_sql} FOR UPDATE"
    return Part(name, sql, params, writes=False)


def _insert_part(
    conn: BaseDatabaseWrapper,
    name: str,
    model: type[models.Model],
    rows: Sequence[Mapping[str, Any]],
    after: str,
) -> Part:
    table = table_of(model, conn)
    count, params = _rows_values(table, rows, conn)
    clocks, params = _with_clocks(table, conn, params)
    if clocks and count != 1:
        raise TypeError(f"{table.name}: a database-clock value in a chained insert of rows")
    key = ("insert_part", count, after, clocks)
    sql = table.sql.get(key)
    if sql is None:
        if count == 1:
            slots = list(table.typed_slots)
            for position, value in clocks:  # the clock's SQL (and its interval's %s) instead
                slots[position] = clock_sql(table.model, value, conn)[0]
            select_sql = f"SELECT {', '.join(slots)} FROM {after}"
        else:
            values = ", ".join([f"({', '.join(table.typed_slots)})"] * count)
            select_sql = f"SELECT v.* FROM (VALUES {values}) AS v, {after}"
        sql = table.sql[key] = f"INSERT INTO {table.name} ({table.insert_columns}) {select_sql}"
    return Part(name, sql, params)


def select(
    model: type[models.Model],
    names: tuple[str | Elapsed | DbNow, ...],
    where: Mapping[str, Any],
    *,
    for_update: bool = False,
    order_by: tuple[str, ...] = (),
    limit: int | None = None,
    reads: tuple[Read, ...] = (),
) -> list[list[Any]]:
    """Rows of `names` (attnames, `Elapsed` verdicts, or `DbNow`: the database clock, plus
    its seconds) matching `where`, converted as the ORM converts them, ordered by `order_by`
    (attnames, ascending; "-name" descending), at most `limit` of them. Each row goes on with
    the value of each of `reads` (`scalar`), as the driver gives it: another table's values
    read in the same round trip and the same snapshot.

    `for_update` locks them (PostgreSQL `FOR UPDATE`; SQLite's write transaction already
    excludes every other writer)."""
    conn = db()
    table = table_of(model, conn)
    where_shape, params = conditions(table, where, conn)
    lock = for_update and conn.features.has_select_for_update
    key = ("select", names, where_shape, lock, order_by, limit, *(read.sql for read in reads))
    clocks = _clock_params.get((names, conn.vendor))
    if clocks is None:
        clocks = _clock_params[(names, conn.vendor)] = [
            p for n in names if n.__class__ is DbNow for p in clock_sql(table.model, n, conn)[1]
        ]
    if clocks or reads:  # their parameters come before the conditions'
        params = [*clocks, *(p for read in reads for p in read.params), *params]
    sql = table.sql.get(key)
    if sql is None:
        columns = ", ".join(
            [_read_sql(table, name, conn) for name in names] + [read.sql for read in reads]
        )
        sql = f"SELECT {columns} FROM {table.name} WHERE {conditions_sql(table, where_shape)}"
        if order_by:
            terms = (
                f"{table.column[n[1:]]} DESC" if n.startswith("-") else table.column[n]
                for n in order_by
            )
            sql += f" ORDER BY {', '.join(terms)}"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        if lock:
            sql += " FOR UPDATE"
        table.sql[key] = sql
    cursor = _cursor(conn)
    cursor.execute(sql, params)
    rows = [list(row) for row in cursor.fetchall()]
    return table.convert(conn, names, rows)


# A select's names → the parameters of the clocks among them (their values are constants).
_clock_params: dict[tuple[Any, str], list[Any]] = {}


def _read_sql(table: Table, name: str | Elapsed | DbNow, conn: BaseDatabaseWrapper) -> str:
    if isinstance(name, DbNow):
        sql: str = clock_sql(table.model, name, conn)[0]  # its parameters: `select`'s
        return sql
    if not isinstance(name, Elapsed):
        return table.column[name]
    now, now_params = clock_sql(table.model, NOW, conn)
    if now_params:  # neither SQLite's nor PostgreSQL's clock takes any
        raise NotImplementedError(f"a database clock with parameters ({conn.vendor})")
    column = table.column[name.name]
    return f"({column} IS NULL OR {column} {'<=' if name.inclusive else '<'} {now})"


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
