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
from uuid import UUID

from django.db import models
from django.db.backends.base.base import BaseDatabaseWrapper

Prep = Callable[[Any, BaseDatabaseWrapper], Any]

# Field types whose get_db_prep_save / get_db_prep_value return a value of exactly this
# Python class unchanged. (A text field returns any str unchanged, a subclass too: `_TEXT`.)
_UNCHANGED = {
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
# Text fields: their to_python returns any str as it is — a str subclass too, such as a
# TextChoices member (a run's or an action's status, in most statements).
_TEXT = frozenset({"CharField", "TextField"})
# What a field class may override to prepare values its own way: a subclass of a Django field
# that overrides none of them prepares every value as that Django field does.
_PREPARING = frozenset(
    {"get_prep_value", "get_db_prep_value", "get_db_prep_save", "to_python", "get_internal_type"}
)


class JsonText(str):
    """A value for a JSONField column, already encoded as JSON text: sent as that text,
    where the field would encode the value again (json.dumps per value, per statement). A
    writer that has the text anyway — the journal hashes each payload's canonical form —
    passes it so. The column receives the same JSON value (PostgreSQL's jsonb keeps no
    formatting; SQLite keeps this text, which the field decodes as it would its own)."""

    __slots__ = ()


# The attribute of a prep function naming the class whose values it returns unchanged (a
# caller on the hottest path checks the class itself and calls it only for other values).
PASSES = "passes"


def passes(prep: Prep) -> type:
    """The class whose values `prep` returns as they are (see PASSES); a class no value has
    if there is none."""
    found: type = getattr(prep, PASSES, _Nothing)
    return found


class _Nothing:
    """No value is of this class."""


def _django_field(field: Any) -> TypeGuard[models.Field[Any, Any]]:
    """Whether `field` prepares values as a Django field class does: it is one, or a
    subclass that overrides none of `_PREPARING` (audit's JournalTime only guards how the
    column is selected)."""
    if field is None:
        return False
    for cls in type(field).__mro__:
        if cls.__module__.startswith("django.db.models."):
            return True
        if _PREPARING.intersection(vars(cls)):
            return False
    return False


def field_prep(field: Any, vendor: str, prep: Prep) -> Prep:
    """`prep(value, conn)` — the field's own get_db_prep_save, or get_db_prep_value — with a
    shortcut for the values the hot path sends on every step, giving what it would return:

    - str, int and bool values of a column of that type: returned unchanged by the field
      (a text field returns a str subclass unchanged too: a TextChoices member);
    - a `UUID` (or None) of a UUIDField, or of a foreign key to one: itself on PostgreSQL
      (a native uuid column), its `.hex` on SQLite — what UUIDField.get_db_prep_value gives;
    - an aware `datetime` (timezone.now(), or a value read back) of a DateTimeField: Django's
      get_prep_value returns it unchanged; PostgreSQL's `adapt_datetimefield_value` too
      (psycopg adapts it), SQLite's turns it into the connection's time zone, drops the
      zone and takes `str()` — which, when it already is in that zone (the same tzinfo
      object: UTC from timezone.now(), or the zone read values are given), is
      `str(value.replace(tzinfo=None))`. None stays None there (both backends' adapters).

    - a `JsonText` of a JSONField: the text it already is (see JsonText).

    Any other value — None, an expression, a naive datetime (Django warns), another zone —
    goes to `prep` itself. So does every value of a field class not Django's own: a custom
    field may prepare any value its own way."""
    target = getattr(field, "target_field", None) if field.is_relation else field
    if not _django_field(field) or not _django_field(target):
        return prep
    internal = target.get_internal_type()
    if internal in _TEXT:

        def text(value: Any, conn: BaseDatabaseWrapper) -> Any:
            return value if isinstance(value, str) else prep(value, conn)

        setattr(text, PASSES, str)
        return text
    if internal == "UUIDField":
        return _uuid(vendor, prep)
    kind = _UNCHANGED.get(internal)
    if kind is not None:

        def plain(value: Any, conn: BaseDatabaseWrapper) -> Any:
            return value if value.__class__ is kind else prep(value, conn)

        setattr(plain, PASSES, kind)
        return plain
    if internal == "JSONField":

        def encoded(value: Any, conn: BaseDatabaseWrapper) -> Any:
            return str(value) if value.__class__ is JsonText else prep(value, conn)

        return encoded
    if field.get_internal_type() != "DateTimeField":
        return prep
    if vendor == "postgresql":

        def aware(value: Any, conn: BaseDatabaseWrapper) -> Any:
            if value.__class__ is datetime and value.tzinfo is not None or value is None:
                return value
            return prep(value, conn)

        return aware
    if vendor == "sqlite":

        def naive_text(value: Any, conn: BaseDatabaseWrapper) -> Any:
            if value.__class__ is datetime and value.tzinfo is not None:
                if value.tzinfo is conn.timezone:
                    return str(value.replace(tzinfo=None))
            elif value is None:
                return None
            return prep(value, conn)

        return naive_text
    return prep


def _uuid(vendor: str, prep: Prep) -> Prep:
    """A UUIDField's (or a foreign key's to one) `prep`, a UUID or None short-circuited."""
    if vendor == "postgresql":

        def native(value: Any, conn: BaseDatabaseWrapper) -> Any:
            return value if value.__class__ is UUID or value is None else prep(value, conn)

        return native
    if vendor == "sqlite":

        def hex_text(value: Any, conn: BaseDatabaseWrapper) -> Any:
            if value.__class__ is UUID:
                return value.hex
            return None if value is None else prep(value, conn)

        return hex_text
    return prep


def save_and_lookup(field: models.Field[Any, Any], vendor: str) -> tuple[Prep, Prep]:
    """(for a value written, for a value compared) — the field's own functions, short-circuited
    by `field_prep`."""

    def lookup(value: Any, conn: BaseDatabaseWrapper) -> Any:
        return field.get_db_prep_value(value, conn, prepared=False)

    return field_prep(field, vendor, field.get_db_prep_save), field_prep(field, vendor, lookup)
