"""ASGI entry point: `uvicorn config.asgi:application` (production and `make run`).

Holdpoint is served over ASGI so that long-lived answers — the live event streams and the
MCP gateway — wait on the event loop instead of holding a sync worker each. Django serves
everything not mounted before it; each Django request still runs its sync view in a thread
of its own (Django's per-request ThreadSensitiveContext).

Like `config.wsgi`, this never reads var/local.env: a production server takes its settings
from its environment alone (`manage.py serve` is the local front door that does).

Persistent database connections are off here (CONN_MAX_AGE 0), as Django's async docs ask:
every request runs in a fresh thread, so a kept connection would never be reused, only left
open until its thread is collected (Django ticket #33497). The workers keep theirs.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

from django.conf import settings  # noqa: E402 (after the environment)
from django.core.asgi import get_asgi_application  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.routing import BaseRoute, Mount  # noqa: E402

django_application = get_asgi_application()
for _database in settings.DATABASES.values():
    _database["CONN_MAX_AGE"] = 0

# What is served beside Django: (route, lifespan) pairs. A lifespan is entered once per
# server process at start-up and left at shutdown (e.g. a session manager's task group).
Lifespan = Callable[[], AbstractAsyncContextManager[Any]]


def mounts() -> list[tuple[BaseRoute, Lifespan | None]]:
    # The MCP gateway (/mcp/<tenant>/). Imported here, and only here: the MCP SDK costs a
    # process 0.6 s to import, which workers and management commands never need.
    from gateway.server import mount

    # The live event streams (?stream=1 of runs/{id}/events/ and approvals/).
    from runtime.api import sse

    return [mount(), *sse.mounts(django_application)]


def build(extra: list[tuple[BaseRoute, Lifespan | None]]) -> Starlette:
    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            for _route, enter in extra:
                if enter is not None:
                    await stack.enter_async_context(enter())
            yield

    routes = [route for route, _ in extra]
    return Starlette(routes=[*routes, Mount("/", app=django_application)], lifespan=lifespan)


application = build(mounts())
