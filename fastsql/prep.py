"""Preparing values for the database the way the ORM does, minus the calls that change nothing.

Before it sends a value the ORM runs it through the field's `get_db_prep_save` (a value
written) or `get_db_prep_value` (a value compared). On the hot path most values are a plain
str or int for a text or integer column, or `timezone.now()` for a timestamp, and for those
the calls return the value unchanged or adapt it trivially — yet each costs a few
microseconds, times every column of every statement of every step. `field_prep` returns the
field's own function with that case short-circuited; every other value still goes through it.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeGuard

from django.db import models
from django.db.backends.base.base import BaseDatabaseWrapper

Prep = Callable[[Any, BaseDatabaseWrapper], Any]

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


class JsonText(str):
    """A value for a JSONField column, already encoded as JSON text: sent as that text,
    where the field would encode the value again (json.dumps per value, per statement). A
    writer that has the text anyway — the journal hashes each payload's canonical form —
    passes it so. The column receives the same JSON value (PostgreSQL's jsonb keeps no
    formatting; SQLite keeps this text, which the field decodes as it would its own)."""

    __slots__ = ()


def _django_field(field: Any) -> TypeGuard[models.Field[Any, Any]]:
    return field is not None and type(field).__module__.startswith("django.db.models.")


def field_prep(field: Any, vendor: str, prep: Prep) -> Prep:
    """`prep(value, conn)` — the field's own get_db_prep_save, or get_db_prep_value — with a
    shortcut for the values the hot path sends on every step, giving what it would return:

    - str, int and bool values of a column of that type: returned unchanged by the field;
    - an aware `datetime` (timezone.now(), or a value read back) of a DateTimeField: Django's
      get_prep_value returns it unchanged; PostgreSQL's `adapt_datetimefield_value` too
      (psycopg adapts it), SQLite's turns it into the connection's time zone, drops the
      zone and takes `str()` — which, when it already is in that zone (the same tzinfo
      object: UTC from timezone.now(), or the zone read values are given), is
      `str(value.replace(tzinfo=None))`.

    - a `JsonText` of a JSONField: the text it already is (see JsonText).

    Any other value — None, an expression, a naive datetime (Django warns), another zone —
    goes to `prep` itself. So does every value of a field class not Django's own: a custom
    field may prepare any value its own way."""
    target = getattr(field, "target_field", None) if field.is_relation else field
    if not _django_field(field) or not _django_field(target):
        return prep
    kind = _UNCHANGED.get(target.get_internal_type())
    if kind is not None:

        def plain(value: Any, conn: BaseDatabaseWrapper) -> Any:
            return value if value.__class__ is kind else prep(value, conn)

        return plain
    if target.get_internal_type() == "JSONField":

        def encoded(value: Any, conn: BaseDatabaseWrapper) -> Any:
            return str(value) if value.__class__ is JsonText else prep(value, conn)

        return encoded
    if field.get_internal_type() != "DateTimeField":
        return prep
    if vendor == "postgresql":

        def aware(value: Any, conn: BaseDatabaseWrapper) -> Any:
            if value.__class__ is datetime and value.tzinfo is not None:
                return value
            return prep(value, conn)

        return aware
    if vendor == "sqlite":

        def naive_text(value: Any, conn: BaseDatabaseWrapper) -> Any:
            if value.__class__ is datetime and value.tzinfo is not None:
                if value.tzinfo is conn.timezone:
                    return str(value.replace(tzinfo=None))
            return prep(value, conn)

        return naive_text
    return prep


def save_and_lookup(field: models.Field[Any, Any], vendor: str) -> tuple[Prep, Prep]:
    """(for a value written, for a value compared) — the field's own functions, short-circuited
    by `field_prep`."""

    def lookup(value: Any, conn: BaseDatabaseWrapper) -> Any:
        return field.get_db_prep_value(value, conn, prepared=False)

    return field_prep(field, vendor, field.get_db_prep_save), field_prep(field, vendor, lookup)
