"""`manage.py serve`: the ASGI server (uvicorn) for local use, with manage.py's settings.

Production runs `uvicorn config.asgi:application` directly, its settings from its
environment; this command exists so that `make run` (and a developer's shell) gets the same
server with var/local.env applied, as every other manage.py line does.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser


class Command(BaseCommand):
    help = "Serve Holdpoint over ASGI (uvicorn): pages, API, live event streams."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)

    def handle(self, *args: Any, **options: Any) -> None:
        import uvicorn  # only this command needs the server

        uvicorn.run(
            "config.asgi:application",
            host=options["host"],
            port=options["port"],
            lifespan="on",
            log_level="info",
        )
