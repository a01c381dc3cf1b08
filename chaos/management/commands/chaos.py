"""`manage.py chaos`: the random-kill soak against real workers (TEST-MATRIX.md, A2).

A thin wrapper: the work is in the `chaos` package (`chaos.driver.run_chaos`). Operators
point it at their own staging task service with --tasks-url; we run it as our soak test.
Exit status 1 when the accounting finds a duplicate, a false completion or a lost run.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from chaos.accounting import table
from chaos.config import MODES, ChaosAborted, ChaosConfig
from chaos.driver import run_chaos


class Command(BaseCommand):
    help = (
        "Start a sandbox and workers, run N api-review runs that create a task while killing "
        "workers at random and at named fault points, then count duplicates, false "
        "completions and lost runs against the task service's own list."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--runs", type=int, required=True, help="how many runs to start")
        parser.add_argument(
            "--kill-every", type=float, required=True, help="seconds between kills (jittered)"
        )
        parser.add_argument("--mode", choices=MODES, default="key", help="the service's dedup")
        parser.add_argument("--workers", type=int, default=2, help="qcluster processes")
        parser.add_argument("--tenant", default="demo", help="tenant slug (created if missing)")
        parser.add_argument("--seed", type=int, default=None, help="kill schedule seed")
        parser.add_argument("--timeout", type=float, default=600.0, help="seconds at most")
        parser.add_argument(
            "--rate", type=float, default=1.0, help="runs started per second (0: all at once)"
        )
        parser.add_argument(
            "--service-delay",
            type=float,
            default=0.0,
            help="seconds our sandbox waits before applying a create (widens the sent window)",
        )
        parser.add_argument(
            "--tasks-url", default=None, help="use this task service instead of a sandbox"
        )
        parser.add_argument(
            "--grace", type=float, default=5.0, help="seconds after SIGTERM before SIGKILL"
        )
        parser.add_argument("--log-dir", default=None, help="worker logs and history here")
        parser.add_argument(
            "--progress", action="store_true", help="draw the progress bar even without a TTY"
        )
        parser.add_argument("--json", action="store_true", help="print the report as JSON")

    def handle(self, *args: Any, **options: Any) -> None:
        verbosity = int(options["verbosity"])
        try:
            config = self.config(options)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        show_bar = options["progress"] or sys.stderr.isatty()
        if verbosity < 3:
            # The driver rings hundreds of doorbells and polls the service: one INFO line
            # each would bury the bar and the table.
            for name in ("django-q", "httpx"):
                logging.getLogger(name).setLevel(logging.WARNING)

        def echo(line: str) -> None:
            self.stderr.write(("\r\033[K" if show_bar else "") + line)

        try:
            report = run_chaos(
                config,
                progress=sys.stderr if show_bar else None,
                echo=echo if verbosity >= 2 else None,
            )
        except ChaosAborted as exc:
            raise CommandError(str(exc)) from None
        if options["json"]:
            self.stdout.write(json.dumps(report.as_dict(), indent=2, default=str))
        else:
            self.stdout.write(table(report))
        if not report.ok:
            sys.exit(1)

    def config(self, options: dict[str, Any]) -> ChaosConfig:
        return ChaosConfig(
            runs=options["runs"],
            kill_every=options["kill_every"],
            mode=options["mode"],
            workers=options["workers"],
            tenant=options["tenant"],
            seed=options["seed"],
            timeout=options["timeout"],
            rate=options["rate"],
            service_delay=options["service_delay"],
            grace=options["grace"],
            tasks_url=options["tasks_url"],
            log_dir=Path(options["log_dir"]) if options["log_dir"] else None,
        )
