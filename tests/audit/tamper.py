"""Tampering as an attacker with database access would: raw SQL, triggers bypassed.

On PostgreSQL the append-only triggers refuse UPDATE/DELETE of history; an attacker who is
a database superuser can switch them off. The tests simulate that by opening the purge gate
inside the tampering transaction, then edit rows with raw SQL — and `audit_verify` must
still notice.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import connection, transaction

from audit.models import PurgeGate


@contextmanager
def tampering() -> Iterator[Any]:
    with transaction.atomic():
        gate = PurgeGate.objects.create(reason="test: an attacker bypassing the triggers")
        with connection.cursor() as cursor:
            yield cursor
        gate.delete()
