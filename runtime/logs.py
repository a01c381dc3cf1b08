"""Structured logs: one formatter for every log line, with the run it is about.

structlog rather than python-json-logger: it renders the *standard library's* records (ours,
Django's, django-q2's) through one processor chain, merges `contextvars` into each line by
itself, and has both renderers we need — JSON for production, a readable console line for
`make run` — so nothing here is a hand-written formatter. The code keeps logging through
`logging.getLogger`; only the formatter knows structlog.

What a line is about is bound where it becomes known — a run's lease taken
(`bind_lease`), an action about to be sent (`bind_action`), a request authenticated
(`bind_tenant`) — in `contextvars`, so every later line of that task or request carries it
without being passed along. A JSON line always has the four keys `run_id`, `action_id`,
`fence`, `tenant` (null when not known), so a log pipeline can index them as columns.
`tenant` is the tenant's id: known without a query on every path (the lease carries it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import structlog
from django.http import HttpRequest, HttpResponse
from structlog.contextvars import bind_contextvars, clear_contextvars, unbind_contextvars
from structlog.typing import EventDict, Processor

FIELDS = ("run_id", "action_id", "fence", "tenant")
FORMATS = ("json", "console")


def _every_field(logger: Any, method: str, event: EventDict) -> EventDict:
    for name in FIELDS:
        event.setdefault(name, None)
    return event


def _logger_name(logger: Any, method: str, event: EventDict) -> EventDict:
    record = event.get("_record")
    if record is not None:
        event["logger"] = record.name
    return event


def formatter(format: str = "json") -> logging.Formatter:
    """The formatter of the root handler (config/settings.py, LOGGING): `json` or `console`."""
    if format not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {format!r}")
    pre_chain: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        _logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    final: list[Processor] = [structlog.stdlib.ProcessorFormatter.remove_processors_meta]
    if format == "json":
        final += [
            _every_field,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ]
    else:
        # A plain traceback, never structlog's default when `rich` is installed: rich's
        # shows every frame's local variables — an agent's key in the frame that read the
        # header, a revealed credential in the one that sends it.
        renderer = structlog.dev.ConsoleRenderer(
            colors=False, exception_formatter=structlog.dev.plain_traceback
        )
        final.append(renderer)
    return structlog.stdlib.ProcessorFormatter(foreign_pre_chain=pre_chain, processors=final)


def bind_lease(run_id: Any, tenant_id: int, fence: int) -> None:
    """A worker took a run's lease: what it logs from now on is about this run. Clears what
    an earlier run of the same task bound."""
    clear_contextvars()
    bind_contextvars(run_id=str(run_id), tenant=tenant_id, fence=fence)


def bind_action(action_id: Any | None) -> None:
    """An action is about to be sent (None: the step moved on, no action is in hand)."""
    if action_id is None:
        unbind_contextvars("action_id")
    else:
        bind_contextvars(action_id=str(action_id))


def bind_tenant(tenant_id: int) -> None:
    """A request was authenticated as acting in this tenant."""
    bind_contextvars(tenant=tenant_id)


@contextmanager
def scope() -> Iterator[None]:
    """One task or request: it starts with nothing bound and leaves nothing behind (a
    worker process or a web thread serves many, one after the other)."""
    clear_contextvars()
    try:
        yield
    finally:
        clear_contextvars()


class RequestContext:
    """Each request's lines carry its run or action when the URL names one; the tenant is
    bound where the request is authenticated (runtime.tenancy, runtime.auth)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        with scope():
            return self.get_response(request)

    def process_view(
        self,
        request: HttpRequest,
        view: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        named = {key: str(kwargs[key]) for key in ("run_id", "action_id") if key in kwargs}
        if named:
            bind_contextvars(**named)
