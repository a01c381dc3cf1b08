"""Tampering as an attacker with database access would: raw SQL, triggers bypassed.

On PostgreSQL the append-only triggers refuse UPDATE/DELETE of history; an attacker who is
a database superuser can switch them off. The tests simulate that by opening the purge gate
inside the tampering transaction, then edit rows with raw SQL — and `audit_verify` must
still notice.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from io import StringIO
from typing import Any

from django.core.management import CommandError, call_command
from django.db import connection, transaction

from audit.models import PurgeGate


@contextmanager
def tampering() -> Iterator[Any]:
    with transaction.atomic():
        gate = PurgeGate.objects.create(reason="test: an attacker bypassing the triggers")
        with connection.cursor() as cursor:
            yield cursor
        gate.delete()


def audit_verify(*args: str) -> tuple[bool, str]:
    """`manage.py audit_verify` as an operator runs it: (passed, what it printed)."""
    out = StringIO()
    try:
        call_command("audit_verify", *args, stdout=out)
    except CommandError:
        return False, out.getvalue()
    return True, out.getvalue()
