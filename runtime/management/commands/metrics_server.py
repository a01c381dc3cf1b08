"""`manage.py metrics_server`: /metrics for a host that runs workers and no web process."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from runtime import metrics


class Command(BaseCommand):
    help = "Serve /metrics (this host's processes' histograms, the database's counts)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=9464)

    def handle(self, *args: Any, host: str, port: int, **options: Any) -> None:
        metrics.serve(host, port)
