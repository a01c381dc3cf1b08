"""No test may leave a database connection behind in a thread that has ended.

A thread that used the ORM and ended without closing its connection (`asyncio.to_thread`,
a `threading.Thread` of a test) leaves that connection open until the garbage collector
happens to free it: on SQLite it keeps the test database from leaving WAL mode ("database
is locked": CI failed on it once, in tests/core/test_doctor.py), on PostgreSQL it is a
backend nobody uses. Each connection is recorded as it opens (Django's
`connection_created`), with the thread that opened it; after each test, one whose thread
has ended and which is still open fails the test that opened it, and is closed.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.signals import connection_created

T = TypeVar("T")
_opened: list[tuple[BaseDatabaseWrapper, threading.Thread]] = []


def _record(sender: Any, connection: BaseDatabaseWrapper, **kwargs: Any) -> None:
    _opened.append((connection, threading.current_thread()))


connection_created.connect(_record, dispatch_uid="tests.orphans")


def _orphans() -> list[str]:
    """The open connections of ended threads (closed here), and forget those closed."""
    found, kept = [], []
    for wrapper, thread in _opened:
        if thread.is_alive():
            kept.append((wrapper, thread))
        elif wrapper.connection is not None:
            found.append(f"{wrapper.alias} in thread {thread.name!r}")
            wrapper.inc_thread_sharing()  # its thread has ended: closed from here
            try:
                wrapper.close()
            finally:
                wrapper.dec_thread_sharing()
    _opened[:] = kept
    return found


@pytest.fixture(autouse=True)
def no_orphan_connections() -> Iterator[None]:
    _orphans()  # what an earlier test's teardown (or no test) left is not this test's
    yield
    found = _orphans()
    if found:
        pytest.fail(
            "a thread ended with its database connection open (close it before the thread"
            " ends: django.db.connection.close()): " + ", ".join(found),
            pytrace=False,
        )


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a thread (an async test's event loop must not block on the database),
    its database connection closed after: `asyncio.to_thread` alone leaves it open."""

    def call() -> T:
        try:
            return fn(*args)
        finally:
            connections.close_all()

    return await asyncio.to_thread(call)
