"""The live event streams (API.md, "Live events") served on the ASGI event loop.

config.asgi routes `runs/{id}/events/` and `approvals/` here before Django. Without
`stream=1` a request goes on to Django untouched. With it, the request still goes through
Django's whole middleware chain and the API view — the same authentication (agent token or
session), throttling, tenant scoping and problem+json refusals as every call — but:

- that synchronous part runs on a small pool of threads of its own (`OPENERS`), and its
  database connection is closed before the first event goes out;
- the answer's body (an async generator, runtime.live) is consumed on the event loop.

Django's own ASGI handler would keep a thread per request for the request's whole life (its
ThreadSensitiveContext pins one executor per request until the response ends); a stream
lives for minutes, so 200 open streams would be 200 parked threads. Here they are 200
coroutines, each awaiting an `asyncio.Event` (runtime.live), and the process holds at most
OPENERS + READERS threads and READERS database connections for them, whatever their
number.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any
from urllib.parse import parse_qs

from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.base import BaseHandler
from django.core.handlers.wsgi import WSGIRequest
from django.db import close_old_connections, connections
from django.http import HttpRequest, HttpResponseBase
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from runtime import live

OPENERS = 8  # threads that authenticate and scope a new stream (then let it go)
API = "/api/v1/"
PATHS = (API + "runs/{run_id}/events/", API + "approvals/")
MARK = "holdpoint.live"  # in the ASGI scope of a request StreamHandler serves


class StreamHandler(ASGIHandler):
    """Django's ASGI handler with its synchronous middleware chain run on `OPENERS`, and no
    per-request thread: the streamed body is Django's own `send_response` loop (which also
    stops the stream when the client hangs up: `listen_for_disconnect`)."""

    def __init__(self) -> None:
        BaseHandler.__init__(self)
        self.load_middleware(is_async=False)
        self.openers = ThreadPoolExecutor(OPENERS, thread_name_prefix="holdpoint-live-open")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        # No ThreadSensitiveContext (see the module); the view learns it may follow live.
        await self.handle({**scope, MARK: True}, receive, send)

    async def run_get_response(self, request: HttpRequest) -> HttpResponseBase:
        loop = asyncio.get_running_loop()
        response = await loop.run_in_executor(self.openers, self._open, request)
        response._handler_class = self.__class__  # type: ignore[attr-defined]
        return response

    def _open(self, request: HttpRequest) -> HttpResponseBase:
        """On an opener thread: the middleware and the view, then this thread's database
        connection closed — the stream reads on runtime.live's readers, never with it."""
        close_old_connections()
        try:
            return self.get_response(request)
        finally:
            connections.close_all()


def follows(request: HttpRequest) -> bool:
    """Is this request served here, on the event loop, so its stream may follow the journal
    live? Elsewhere (a WSGI server, Django's test client, Django's own ASGI handler) a
    stream sends what is there and closes, and the client resumes with Last-Event-ID: a
    long poll, never a sync worker held for the life of a stream."""
    scope = getattr(request, "scope", None)
    return bool(scope and scope.get(MARK))


def iterates(request: HttpRequest) -> bool:
    """Is this request's body iterated synchronously (a WSGI server, Django's test client)?
    Its stream is then a plain iterator read in the request's own thread: an async body
    would be buffered whole by Django on an event loop of the thread's own, and loops of
    several threads at once shared the doorbell's reads, which belong to one loop
    ("attached to a different loop")."""
    return isinstance(request, WSGIRequest)


def wants_stream(scope: Scope) -> bool:
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    return query.get("stream") == ["1"]


class Streams:
    """The ASGI app of the streamed paths: `stream=1` to the StreamHandler, the rest to
    Django as usual (lists, long polls, a POST's 405)."""

    def __init__(self, django: ASGIApp) -> None:
        self.django = django
        self.handler: StreamHandler | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not wants_stream(scope):
            await self.django(scope, receive, send)
            return
        if self.handler is None:
            self.handler = StreamHandler()
        await self.handler(scope, receive, send)

    @asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        restore = close_streams_on_exit(asyncio.get_running_loop())
        async with live.lifespan():
            try:
                yield
            finally:
                restore()
                if self.handler is not None:
                    self.handler.openers.shutdown(wait=False, cancel_futures=True)


EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def close_streams_on_exit(loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
    """Chain the server's own exit signal handlers so that a stop also ends the streams;
    returns what puts them back.

    uvicorn, told to stop, stops accepting, then waits for every open response to end
    before its lifespan's shutdown — and a stream of a live run does not end: a process
    with one open stream went on serving it, refusing every new connection, until it was
    killed (a supervisor's SIGKILL after its grace). Its handlers are installed before the
    lifespan starts (uvicorn.Server.capture_signals), so the ones found here are chained:
    they still stop the server, and each stream ends (live.Doorbell.close); its client
    resumes with Last-Event-ID, at another process or this one restarted."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # only the main thread gets signals
    chained = {sig: h for sig in EXIT_SIGNALS if callable(h := signal.getsignal(sig))}

    def on_exit(sig: int, frame: FrameType | None) -> None:
        loop.call_soon_threadsafe(live.doorbell.close)
        chained[signal.Signals(sig)](sig, frame)

    for sig in chained:
        signal.signal(sig, on_exit)

    def restore() -> None:
        for sig, handler in chained.items():
            if signal.getsignal(sig) is on_exit:
                signal.signal(sig, handler)

    return restore


def mounts(django: ASGIApp) -> list[tuple[BaseRoute, Any]]:
    """config.asgi's (route, lifespan) pairs for the streamed paths (one lifespan for all)."""
    app = Streams(django)
    routes: list[tuple[BaseRoute, Any]] = [(Route(path, app), None) for path in PATHS]
    routes[0] = (routes[0][0], app.lifespan)
    return routes
