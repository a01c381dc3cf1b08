"""The doorbell: tell workers a run may have work. Never the source of truth.

A lost message is found by the sweeper; a duplicated one finds the lease held and exits.
Always rung after commit, so a worker never wakes to a row it cannot see yet.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction


def ring(run_id: Any) -> None:
    # robust: a broker hiccup after commit must not turn a committed change into a 500;
    # the sweeper rings the run again from database truth.
    transaction.on_commit(lambda: _enqueue(str(run_id)), robust=True)


def _enqueue(run_id: str) -> None:
    from django_q.tasks import async_task

    async_task("runtime.tasks.advance", run_id)


def enqueue_task(func: str, *args: Any) -> None:
    """Enqueue a django-q2 task now (outside a transaction: its rows are committed)."""
    from django_q.tasks import async_task

    async_task(func, *args)


def on_commit_task(func: str, *args: Any) -> None:
    """Enqueue a django-q2 task after the surrounding transaction commits."""
    transaction.on_commit(lambda: enqueue_task(func, *args), robust=True)


# The task that sends an action no step drives (a compensation): runtime.tasks.
SENDER = "runtime.tasks.dispatch_standalone"


def ring_sender(action_id: Any) -> None:
    """Ring a standalone action's sender after the surrounding transaction commits (the
    queue is a doorbell: the send re-reads the row, and its compare-and-swap to `sent`
    keeps two rings to one send). Here, beside the run's doorbell, so that the ledger —
    which rings it when a person's "not applied" puts an undo back — need not import the
    compensation module built on it."""
    on_commit_task(SENDER, str(action_id))
