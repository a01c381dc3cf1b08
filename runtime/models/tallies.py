"""Counts that must outlive the rows they were taken from."""

from __future__ import annotations

from django.db import IntegrityError, models, transaction
from django.db.models import F


class Tally(models.Model):
    """A named count that only grows.

    A Prometheus counter must never go down. `holdpoint_lease_takeovers_total` is counted from
    the journal's takeover entries, and the retention purge replaces those entries' payloads
    by digests: so the purge adds what it redacts here, in its own transaction, and the
    metric is the two read in one statement (runtime.metrics).
    """

    name = models.CharField(primary_key=True, max_length=64)
    value = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.name} = {self.value}"

    @classmethod
    def add(cls, name: str, amount: int) -> None:
        """Add `amount` to the tally `name` (created at its first use), in the caller's
        transaction."""
        if amount <= 0:
            return
        if cls.objects.filter(name=name).update(value=F("value") + amount):
            return
        try:
            with transaction.atomic():
                cls.objects.create(name=name, value=amount)
        except IntegrityError:  # created meanwhile by a purge beside this one
            cls.objects.filter(name=name).update(value=F("value") + amount)
