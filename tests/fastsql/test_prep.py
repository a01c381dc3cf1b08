"""fastsql.prep's shortcuts give exactly what the field's own functions give, for every column
of every model and every kind of value the hot path sends (and some it never should), on the
database the tests run on. A shortcut that disagreed would write or compare another value."""

from __future__ import annotations

import uuid
import warnings
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from django.apps import apps
from django.db import connection, models

from fastsql.prep import JsonText, passes, save_and_lookup
from runtime.models import ActionStatus, RunStatus

VALUES: list[Any] = [
    "text",
    "",
    JsonText('{"a": 1}'),
    ActionStatus.SENT,  # a TextChoices member: a str subclass
    RunStatus.RUNNING,
    7,
    0,
    True,
    False,
    None,
    uuid.UUID("12345678-1234-5678-1234-567812345678"),
    "12345678-1234-5678-1234-567812345678",
    datetime(2026, 12, 7, 6, 0, tzinfo=UTC),
    datetime(2026, 12, 7, 6, 0, tzinfo=timezone(timedelta(hours=2))),
    datetime(2026, 12, 7, 6, 0),  # naive: the field warns and makes it aware
    {"a": [1, "b"]},
    2.5,
]


def _fields() -> list[models.Field[Any, Any]]:
    return [
        field
        for config in apps.get_app_configs()
        if config.name in {"runtime", "audit", "approvals", "gateway"}
        for model in config.get_models()
        for field in model._meta.concrete_fields
    ]


def _outcome(prep: Any, *args: Any) -> Any:
    """What a prep gave — the value and its class (a Jsonb by what it wraps) — or raised."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            value = prep(*args)
    except Exception as exc:  # the same refusal, by class
        return ("raised", type(exc))
    if hasattr(value, "obj") and hasattr(value, "dumps"):  # psycopg's Jsonb
        return ("jsonb", value.obj)
    if isinstance(value, int) and type(value).__module__.startswith("psycopg"):
        # Django's PostgreSQL adapter wraps an integer column's int as Int2/Int4/Int8; the
        # shortcut sends the int itself, the same number (the prepared statement types it).
        return (int, int(value))
    return (type(value), value)


@pytest.mark.django_db
def test_every_shortcut_gives_what_the_field_gives_for_every_value() -> None:
    fields = _fields()
    assert any(f.get_internal_type() == "UUIDField" for f in fields)
    checked = 0
    for field in fields:
        save, lookup = save_and_lookup(field, connection.vendor)
        for value in VALUES:
            if value.__class__ is JsonText and field.get_internal_type() == "JSONField":
                # The one shortcut that differs on purpose: the JSON text a writer already
                # has goes as that text, where the field would encode it (fastsql.prep).
                assert save(value, connection) == lookup(value, connection) == str(value)
                continue
            expected_save = _outcome(field.get_db_prep_save, value, connection)
            assert _outcome(save, value, connection) == expected_save, (field, value)
            expected = _outcome(field.get_db_prep_value, value, connection, False)
            assert _outcome(lookup, value, connection) == expected, (field, value)
            if value.__class__ is passes(save):  # what an insert sends without calling it
                assert _outcome(lambda v: v, value) == expected_save, (field, value)
            checked += 1
    assert checked > 1000


@pytest.mark.django_db
def test_a_field_subclass_that_prepares_nothing_its_own_way_takes_the_shortcut() -> None:
    """audit's JournalTime only changes how the column is selected: its values are prepared
    as a DateTimeField's, by the shortcut; a subclass that overrides a prep method is not."""
    from audit.models import JournalEntry

    save, _ = save_and_lookup(JournalEntry._meta.get_field("created_at"), connection.vendor)
    assert save is not JournalEntry._meta.get_field("created_at").get_db_prep_save

    class Shouting(models.CharField[str, str]):
        def get_prep_value(self, value: Any) -> Any:
            return str(value).upper()

    field = Shouting(max_length=10)
    save, lookup = save_and_lookup(field, connection.vendor)
    assert save("quiet", connection) == "QUIET"
    assert lookup("quiet", connection) == "QUIET"
