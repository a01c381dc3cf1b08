"""Live event streams' plumbing: one doorbell per web process, bounded reads, SSE framing.

A stream client (runtime/api/streams.py, approvals/api.py) is an async generator on the
server's event loop (runtime.api.sse serves it), not a sync worker. While it waits it holds
no thread and no database connection: it awaits an `asyncio.Event` that the process's one
doorbell rings.

On both databases the doorbell polls: while the process has streams open, it reads the
watched stream heads (one indexed query for all of them, on a reader thread) every
`POLL_SECONDS` and rings the keys whose head moved; with none open it sleeps without
querying. PostgreSQL's LISTEN/NOTIFY was dropped (audit migration 0009): the NOTIFY trigger
ran in every journal append, i.e. every step commit of every worker, and a notifying
transaction takes a cluster-wide lock at commit until its commit is flushed, serializing
all of them; LISTEN also needs a connection of its own per process and does not work
through a pooler in transaction mode. A poll costs the waiting a fraction of a second.

A doorbell is never the data: after a ring, a subscriber re-reads what is past its last seq,
so a missed or coalesced ring delays an entry, never loses it — and every heartbeat (after
`settings.HOLDPOINT_SSE_KEEPALIVE` quiet seconds, 15 by default) re-reads too.

Reads run on `READERS` threads of their own, each keeping one database connection, so N
streams cost at most READERS connections per process, whatever N; identical reads in
flight at once (200 clients of one run woken by one commit) are made once (`read`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connection, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.http import StreamingHttpResponse

log = logging.getLogger(__name__)
T = TypeVar("T")

# How stale a wake-up may be: a reviewer or an agent waiting on a stream sees an entry within
# about this long (half of it on average). The price is one indexed read of the watched heads
# per web process per interval, and only while it has streams open.
POLL_SECONDS = 0.25
READERS = 4
RETRY_SECONDS = 1.0
LOG_EVERY = 15.0  # seconds between two lines about streams' failed reads (read_failed)


def _readers() -> tuple[ThreadPoolExecutor, list[BaseDatabaseWrapper]]:
    """A pool of reader threads, and the database connection object of each thread it
    starts (registered as the thread starts: the pool's scheduling decides which thread
    runs a task, so a close cannot be sent to each thread as a task)."""
    kept: list[BaseDatabaseWrapper] = []
    pool = ThreadPoolExecutor(
        READERS,
        thread_name_prefix="holdpoint-live-read",
        initializer=lambda: kept.append(connections[DEFAULT_DB_ALIAS]),
    )
    return pool, kept


def _read_in_thread(fn: Callable[[], T]) -> T:
    """One reader thread's call: its kept connection is dropped after a database error, so
    the next read reconnects (a restarted database, a killed backend). On SQLite it is
    closed after every read: opening one is a file open, and a connection kept by an idle
    reader thread blocks whoever needs the file alone (leaving WAL mode, a VACUUM) with
    "database is locked"."""
    try:
        return fn()
    except DatabaseError:
        connection.close()
        raise
    finally:
        if connection.vendor == "sqlite":
            connection.close()


class _Failures:
    """A failed read is every open stream's at once (the database away: each of 200 streams
    retries every RETRY_SECONDS), so it is logged once per LOG_EVERY seconds for the whole
    process, with its traceback and how many were not — not a traceback per stream per try."""

    def __init__(self) -> None:
        self.logged = -LOG_EVERY
        self.unsaid = 0

    def say(self, logger: logging.Logger, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self.logged < LOG_EVERY:
            self.unsaid += 1
            return
        unsaid, self.unsaid, self.logged = self.unsaid, 0, now
        if unsaid:
            message, args = message + " (and %d more since the last such line)", (*args, unsaid)
        logger.exception(message, *args)


class Doorbell:
    """The process's wake-ups, keyed by stream ("run:<id>", "tenant:<id>")."""

    def __init__(self) -> None:
        self.waiters: defaultdict[str, set[asyncio.Event]] = defaultdict(set)
        self.readers, self.kept = _readers()
        self.inflight: dict[Hashable, asyncio.Future[Any]] = {}
        self.task: asyncio.Task[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closing = False  # the server is stopping: streams end (close)
        # Its poll failing is logged once per LOG_EVERY (the database away, it tries again
        # every POLL_SECONDS), apart from the streams' own failed reads.
        self.failed = _Failures().say

    @contextlib.asynccontextmanager
    async def subscription(self, *keys: str) -> AsyncIterator[asyncio.Event]:
        """An event rung when any of `keys` moves; the doorbell starts with the first one."""
        self._start()
        event = asyncio.Event()
        for key in keys:
            self.waiters[key].add(event)
        try:
            yield event
        finally:
            for key in keys:
                self.waiters[key].discard(event)
                if not self.waiters[key]:
                    del self.waiters[key]

    async def read(self, key: Hashable, fn: Callable[[], T]) -> T:
        """`fn()` on a reader thread; callers asking the same `key` meanwhile share the
        answer (a read by `seq > last` gives every caller at that `last` the same rows)."""
        future = self.inflight.get(key)
        if future is None:
            loop = asyncio.get_running_loop()
            future = asyncio.ensure_future(loop.run_in_executor(self.readers, _read_in_thread, fn))
            self.inflight[key] = future
            future.add_done_callback(lambda _: self.inflight.pop(key, None))
        result: T = await asyncio.shield(future)
        return result

    def ring(self, *keys: str) -> None:
        for key in keys:
            for event in self.waiters.get(key, ()):
                event.set()

    def ring_all(self) -> None:
        for events in self.waiters.values():
            for event in events:
                event.set()

    def close(self) -> None:
        """The server is stopping (runtime.api.sse): every stream ends at its next look
        (runtime.api.streams.Recheck), and those waiting are woken to look now."""
        self.closing = True
        self.ring_all()

    async def stop(self) -> None:
        """Stop polling and the readers (the connections they kept are closed)."""
        task, self.task = self.task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.get_running_loop().run_in_executor(None, self.close_readers)
        self.closing = False  # a process that goes on (a test session) serves again

    def close_readers(self) -> None:
        """End the reader threads (reads already asked finish first), then close the
        connection each of them kept. A web process's readers live as long as it does, and
        its exit closes their sockets; a process that goes on (a test session, before it
        drops the test database: "being accessed by other users", and the database was left
        behind) must close them itself. New readers start with the next read."""
        readers, kept = self.readers, self.kept
        self.readers, self.kept = _readers()
        readers.shutdown(wait=True)
        for wrapper in kept:  # each thread has ended: its connection is closed from here
            wrapper.inc_thread_sharing()
            try:
                wrapper.close()
            finally:
                wrapper.dec_thread_sharing()

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.task is not None and not self.task.done() and self.loop is loop:
            return
        self.loop = loop
        self.task = loop.create_task(self._poll(), name="holdpoint-live-doorbell")

    async def _poll(self) -> None:
        seen: dict[str, Any] = {}
        while True:
            try:
                keys = list(self.waiters)
                if not keys:
                    seen = {}
                    await asyncio.sleep(POLL_SECONDS)
                    continue
                heads = await self.read(("heads", *keys), partial(_heads, keys))
                for key, value in heads.items():
                    # A key seen for the first time rings too: its subscriber read before
                    # this poll, and an append in between would otherwise become the
                    # baseline, unrung until the next heartbeat (a spare re-read is cheap).
                    if seen.get(key) != value:
                        self.ring(key)
                seen = heads
            except asyncio.CancelledError:
                raise
            except Exception:
                self.failed(log, "live events: polling the stream heads failed")
            await asyncio.sleep(POLL_SECONDS)


@contextlib.asynccontextmanager
async def unwatched() -> AsyncIterator[asyncio.Event]:
    """An event nothing rings, for a stream that does not follow (it never waits on it)."""
    yield asyncio.Event()


def _heads(keys: list[str]) -> dict[str, Any]:
    """Where each watched stream's head is: one read by audit_streamhead's primary key."""
    from audit.models import StreamHead

    return dict(StreamHead.objects.filter(stream__in=keys).values_list("stream", "seq"))


doorbell = Doorbell()


read_failed = _Failures().say


def event(data: bytes, *, type: str, id: int | None = None) -> bytes:
    """One server-sent event; `data` is compact JSON, so it is one line."""
    head = f"id: {id}\n" if id is not None else ""
    return f"{head}event: {type}\n".encode() + b"data: " + data + b"\n\n"


def position(id: int) -> bytes:
    """An `id:` with no data: no event (EventSource dispatches none), but where a client
    resumes from — EventSource's lastEventId is set from it, as live.js's is."""
    return f"id: {id}\n\n".encode()


class Slot:
    """One open stream's place among its holder's (`Slots.take`). `release` may come more
    than once and from any thread — the body's end, the response's garbage collection — and
    frees the place once: it only queues the place (queue.SimpleQueue.put is safe even in
    a weakref callback that interrupts the thread holding the slots' lock)."""

    def __init__(self, freed: queue.SimpleQueue[tuple[Hashable, int]], holder: Hashable) -> None:
        self.freed, self.holder, self.id = freed, holder, next(_slot_ids)

    def release(self) -> None:
        self.freed.put((self.holder, self.id))


_slot_ids = itertools.count(1)


class Slots:
    """The live event streams open in this process, per holder (an account): each holds a
    file descriptor and a coroutine for as long as it lives, so one token opening hundreds
    would exhaust the process (HOLDPOINT_STREAMS_PER_TOKEN). Counted here, not in the
    database: a process's own descriptors are what runs out, and a count in a table would
    outlive a process killed with its streams open."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: dict[Hashable, set[int]] = {}
        self.freed: queue.SimpleQueue[tuple[Hashable, int]] = queue.SimpleQueue()

    def take(self, holder: Hashable, limit: int) -> Slot | None:
        """A place for one more stream of `holder`, or None if it has `limit` open."""
        with self.lock:
            self._drain()
            held = self.open.setdefault(holder, set())
            if len(held) >= limit:
                return None
            slot = Slot(self.freed, holder)
            held.add(slot.id)
            return slot

    def _drain(self) -> None:
        while True:
            try:
                holder, id = self.freed.get_nowait()
            except queue.Empty:
                return
            held = self.open.get(holder)
            if held is not None:
                held.discard(id)
                if not held:
                    del self.open[holder]


slots = Slots()


OPEN = b": stream open\n\n"  # headers and a first byte go out at once


async def _framed(events: AsyncIterator[bytes], slot: Slot | None) -> AsyncIterator[bytes]:
    try:
        yield OPEN
        async for chunk in events:
            yield chunk
    finally:
        if slot is not None:  # ended, its client gone (cancelled), or the server stopping
            slot.release()


def _framed_sync(events: Iterator[bytes], slot: Slot | None) -> Iterator[bytes]:
    try:
        yield OPEN
        yield from events
    finally:
        if slot is not None:
            slot.release()


def response(
    events: AsyncIterator[bytes] | Iterator[bytes], slot: Slot | None = None
) -> StreamingHttpResponse:
    """`text/event-stream`: an async body is consumed on the event loop by runtime.api.sse
    (config.asgi routes `?stream=1` there); under WSGI the body is a plain iterator
    (runtime.api.sse.iterates), which the server sends as it is read. `slot` (Slots.take)
    is released when the body ends however it ends — or, for a response never sent (its
    client left while the view ran, a middleware answered instead), once the response is
    collected: a body that never started runs no `finally`."""
    if isinstance(events, AsyncIterator):
        body: AsyncIterator[bytes] | Iterator[bytes] = _framed(events, slot)
    else:
        body = _framed_sync(events, slot)
    answer = StreamingHttpResponse(body, content_type="text/event-stream")
    if slot is not None:
        weakref.finalize(answer, slot.release)
    answer["Cache-Control"] = "no-cache"
    answer["X-Accel-Buffering"] = "no"  # a fronting nginx must not buffer the stream
    return answer


@contextlib.asynccontextmanager
async def lifespan() -> AsyncIterator[None]:
    """The web process's doorbell, stopped at shutdown (config.asgi enters this once)."""
    try:
        yield
    finally:
        await doorbell.stop()


async def heartbeat_or_wake(wake: asyncio.Event, seconds: float | None = None) -> bool:
    """Wait for a ring, or `seconds` (HOLDPOINT_SSE_KEEPALIVE by default; API.md: a comment
    line at least every 15 s by default); True if it rang. The caller clears the event
    *before* it reads, so a ring during the read is never lost.

    `asyncio.timeout`, not `asyncio.wait_for`: on Python 3.11 wait_for swallows a
    cancellation that arrives after the event was set and before it resumed (a client that
    leaves in the turn its stream was rung), and the stream would go on for ever."""
    try:
        wait = settings.HOLDPOINT_SSE_KEEPALIVE if seconds is None else seconds
        async with asyncio.timeout(wait):
            await wake.wait()
    except TimeoutError:
        return False
    return True
