"""`GET runs/{id}/events/?stream=1` (API.md, "Live events"): a run's journal as server-sent
events — `id:` the entry's seq, `event:` its type, `data:` the entry as the list shows it.

The view (runtime.api.views.Events) authenticates and scopes once, as every API call does,
then answers with `run_events`, an async generator on the server's event loop (runtime.live
says what it holds while it waits: nothing but an `asyncio.Event`). Exactness rests on the
seq alone: each read asks for `seq > last` in seq order, so a resumed stream (Last-Event-ID)
neither loses nor repeats an entry, however the wake-ups were missed or merged.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Iterator
from functools import partial
from typing import Any, TypeVar

from django.conf import settings
from django.db import DatabaseError
from django.http import StreamingHttpResponse
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request

from audit import journal
from runtime import live
from runtime.api.base import ApiView
from runtime.api.serializers import JournalEntrySerializer
from runtime.auth import Standing
from runtime.errors import InvalidParams, TooManyStreams
from runtime.models import TERMINAL, Run
from runtime.tenancy import Principal, journal_for

log = logging.getLogger(__name__)
T = TypeVar("T", bound=int | None)
BATCH = 200  # entries per read; a long journal streams in batches


# The OpenAPI side (drf-spectacular), shared by both streaming lists.
PARAMETERS = [
    OpenApiParameter(
        "stream",
        str,
        enum=["1"],
        description="1: answer text/event-stream, following new entries live (API.md)",
    ),
    OpenApiParameter(
        "Last-Event-ID",
        int,
        OpenApiParameter.HEADER,
        description="with stream=1: resume after this seq (what EventSource sends back)",
    ),
]
AFTER = OpenApiParameter(
    "after", int, description="with stream=1: only what comes after this id (Last-Event-ID wins)"
)
DESCRIPTION = (
    "With `stream=1`: server-sent events, one per entry (`id:` seq, `event:` type, `data:` "
    "the entry as JSON), from `Last-Event-ID` (or `after`) on, a comment line at least every "
    "15 s, closed after the run's final entry."
)
# Each server-sent event as a client parses it (`id:`, `event:`, `data:` lines): a string
# per field; `data` is the JSON the description names.
EVENT_STREAM = OpenApiResponse(
    {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "event": {"type": "string"},
            "data": {"type": "string"},
        },
    },
    description="text/event-stream (with stream=1), one server-sent event each, see above",
)


def requested(request: Request) -> bool:
    """`stream=1` asks for the stream; no `stream` for the list. Any other value is refused
    (422) rather than read as "no": the document allows only "1"."""
    value = request.query_params.get("stream")
    if value is None or value == "1":
        return value == "1"
    raise InvalidParams('stream must be "1" (or absent)', errors={"stream": ['only "1"']})


class StreamingList(ApiView):
    """An API list that also streams. EventSource asks with `Accept: text/event-stream`,
    which DRF's content negotiation would refuse (406) before the view runs: with stream=1
    negotiation falls back to the API's renderer, so a refusal (401, 404, 422) is still
    problem+json and the stream itself is a plain StreamingHttpResponse."""

    def perform_content_negotiation(self, request: Request, force: bool = False) -> Any:
        return super().perform_content_negotiation(request, force or requested(request))


def opened(
    principal: Principal, events: AsyncIterator[bytes] | Iterator[bytes], *, follow: bool
) -> StreamingHttpResponse:
    """The stream's response. One that `follow`s (runtime.api.sse.follows) lives as long as
    its client stays, holding a file descriptor of the web process: it opens only if the
    principal's account has fewer than HOLDPOINT_STREAMS_PER_TOKEN open in this process
    (live.Slots), and gives its place back when it ends, however it ends — else 429
    `throttled`, Retry-After one keep-alive interval (within which a stream whose
    credentials lapsed ends). One that sends what is there and ends takes no place."""
    if not follow:
        return live.response(events)
    limit = settings.HOLDPOINT_STREAMS_PER_TOKEN
    slot = live.slots.take(principal.user.pk, limit)
    if slot is None:
        raise TooManyStreams(
            f"at most {limit} live event streams of one account may be open at once here: "
            "close one (the run page and the inbox poll instead meanwhile)",
            retry_after=settings.HOLDPOINT_SSE_KEEPALIVE,
        )
    return live.response(events, slot)


def after(request: Request, default: T) -> int | T:
    """The `after` query parameter (a seq, or an approvals stream's event id), else `default`."""
    raw = request.query_params.get("after")
    return default if raw is None else _position(raw, "after")


def resume_after(request: Request, after: T) -> int | T:
    """Where a stream starts: after the `Last-Event-ID` a reconnecting client sends (it
    wins: a browser reconnects to the URL it first opened), else after `after`. An empty
    one is no id either (EventSource sends none rather than an empty one)."""
    raw = request.headers.get("Last-Event-ID")
    return after if raw is None else _position(raw, "Last-Event-ID")


def _position(raw: str, name: str) -> int:
    """A position in ASCII digits, an optional minus before them (before everything): Python's
    int() also reads "1_0", " 7", "+7" and other scripts' digits, none of which any id this
    API gave looks like, and raises on more than 4,300 digits. One past every id is after
    everything (an empty page), not an error."""
    if _POSITION.fullmatch(raw):
        try:
            return int(raw)
        except ValueError:  # past int()'s digit limit
            pass
    raise InvalidParams(f"{name} must be a sequence number", errors={name: ["an integer"]})


_POSITION = re.compile(r"-?[0-9]+")


KEEP_ALIVE = b": keep-alive\n\n"


class Recheck:
    """Asks, while a stream lives, whether what opened it still stands (runtime.auth.Standing):
    at every keep-alive, after a wake-up once a keep-alive interval has passed since the
    last look, and between two batches of a backlog (`between`) — so a stream ends within
    one interval (HOLDPOINT_SSE_KEEPALIVE, 15 s), or one batch, of its token's revocation,
    its session's logout or expiry, or its principal's change. A read
    that fails (the database away) keeps the stream: the next look judges again."""

    def __init__(self, standing: Standing | None) -> None:
        self.standing = standing
        self.looked = self.spoke = time.monotonic()

    async def wait(self, wake: asyncio.Event) -> bytes | None:
        """A stream's wait between reads (live.heartbeat_or_wake), then the look: None if
        the stream must end, else what to send first — a keep-alive once an interval has
        passed since the last one, nothing else. Counted from the last keep-alive, not from
        the last wake-up: wake-ups that send nothing (an approvals stream is rung by every
        append in its tenant) must not keep the comment line from ever going out."""
        if live.doorbell.closing:  # the server is stopping: the client resumes elsewhere
            return None
        left = settings.HOLDPOINT_SSE_KEEPALIVE - (time.monotonic() - self.spoke)
        woken = await live.heartbeat_or_wake(wake, max(left, 0.0))
        if live.doorbell.closing or not await self.holds(quiet=not woken):
            return None
        return self._due()

    async def between(self) -> bool:
        """Between two batches of a backlog: whether to read the next. A stream far behind
        (a client resuming a long journal) reads batch after batch without waiting, so the
        looks `wait` makes never came: a revoked token kept its stream until it had caught
        up — tens of thousands of entries — and a stopping server waited for it. Asked at
        every batch: one indexed read per BATCH entries sent."""
        return not live.doorbell.closing and await self.holds(quiet=True)

    async def pause(self) -> bytes:
        """After a failed read (the database away), the pause before the next try, then a
        keep-alive if one is due: a stream held open through an outage still says it lives
        (else a proxy closes it as idle, and the reconnect meets the outage at its
        authentication)."""
        await asyncio.sleep(live.RETRY_SECONDS)
        return self._due()

    def _due(self) -> bytes:
        if time.monotonic() - self.spoke < settings.HOLDPOINT_SSE_KEEPALIVE:
            return b""
        self.spoke = time.monotonic()
        return KEEP_ALIVE

    async def holds(self, *, quiet: bool) -> bool:
        if self.standing is None:
            return True
        if not quiet and time.monotonic() - self.looked < settings.HOLDPOINT_SSE_KEEPALIVE:
            return True
        self.looked = time.monotonic()
        try:
            return await live.doorbell.read(("standing", self.standing), self.standing.holds)
        except DatabaseError:
            log.exception("live events: checking a stream's credentials failed")
            return True


def _encode(entries: list[Any]) -> list[tuple[int, bytes]]:
    render = JSONRenderer().render
    return [
        (e.seq, live.event(render(JournalEntrySerializer(e).data), type=e.type, id=e.seq))
        for e in entries
    ]


def _after(principal: Principal, run_id: Any, last: int) -> tuple[list[tuple[int, bytes]], bool]:
    """On a reader thread: the entries after `last`, encoded, and whether they end the stream.
    The run's status is read *before* the entries: a run seen finished has committed its
    final entry with that status, so the entries read next include it. A run gone (the
    retention purge deleted it while its stream was read) is finished too: its journal
    stays, redacted, and nothing appends to it again — else the stream waited for ever."""
    status = Run.objects.filter(pk=run_id).values_list("status", flat=True).first()
    entries = journal_for(principal).filter(stream=journal.run_stream(run_id), seq__gt=last)
    batch = list(entries.order_by("seq")[:BATCH])
    finished = status is None or status in TERMINAL
    return _encode(batch), finished and len(batch) < BATCH


def run_events_now(
    principal: Principal, run_id: Any, after: int, standing: Standing | None = None
) -> Iterator[bytes]:
    """The run's entries after `after` there are now, then the end, read batch by batch in
    the calling thread: a stream whose body is iterated synchronously (runtime.api.sse
    .iterates). A database error ends the stream; the client resumes from its last id. It
    also ends between two batches once what opened it (`standing`) no longer stands, as a
    followed stream does (`Recheck.between`)."""
    last = after
    while True:
        events, _ = _after(principal, run_id, last)
        for seq, chunk in events:
            yield chunk
            last = seq
        if len(events) < BATCH or not still_stands(standing):
            return


def still_stands(standing: Standing | None) -> bool:
    """Between two batches of a synchronously read stream: `Recheck.between`'s look."""
    return standing is None or standing.holds()


async def run_events(
    principal: Principal,
    run_id: Any,
    after: int,
    *,
    follow: bool = True,
    standing: Standing | None = None,
) -> AsyncIterator[bytes]:
    """The run's entries after `after`; `follow`: live, to the run's final entry (else the
    entries there are now, then the end: runtime.api.sse.follows), or until what opened the
    stream (`standing`) no longer stands (`Recheck`)."""
    last = after
    recheck = Recheck(standing)
    # A stream that ends with what is there waits for nothing: it must not start the
    # doorbell (under Django alone its event loop ends with the response).
    watch = live.doorbell.subscription(journal.run_stream(run_id)) if follow else live.unwatched()
    async with watch as wake:
        while True:
            wake.clear()
            try:
                events, finished = await live.doorbell.read(
                    ("run", run_id, last), partial(_after, principal, run_id, last)
                )
            except DatabaseError:
                live.read_failed(log, "live events: reading run %s failed; retrying", run_id)
                if alive := await recheck.pause():
                    yield alive
                continue
            for seq, chunk in events:
                yield chunk
                last = seq
            if len(events) == BATCH:
                if not await recheck.between():
                    return
                continue
            if finished or not follow:
                return
            first = await recheck.wait(wake)
            if first is None:
                return
            if first:
                yield first
