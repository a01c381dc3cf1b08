"""Whose turn it is to sweep."""

from __future__ import annotations

from django.db import models


class SweeperTurn(models.Model):
    """The fleet's sweep slot: one row per sweeper (today one, "sweeper").

    Every worker process runs a sweeper loop (runtime.sweeper.SweeperThread) so a crashed
    worker's run is picked up seconds after its lease ends, from the moment any cluster is
    up — not when django-q2's scheduler first fires, 30 s after a cluster starts. A tick
    sweeps only if it moves `next_at` forward from the past (a compare-and-swap on the
    database clock), so N processes on M hosts still sweep about once per interval between
    them, and a process that dies simply stops taking turns.
    """

    name = models.CharField(primary_key=True, max_length=40)
    next_at = models.DateTimeField()
    holder = models.CharField(max_length=200, blank=True, default="")

    def __str__(self) -> str:
        return f"{self.name}: next at {self.next_at:%H:%M:%S} ({self.holder or 'nobody yet'})"
