"""`manage.py doctor`: the settings that would silently break a guarantee, one line each.

The checks are `runtime.health`'s, the same /readyz reports in its details. Exit 1 when any
error is found. A warning (a write tool no policy names: safe, held by default, but the
admin should know) is printed and, as with `manage.py check`, fails only with
`--fail-level warning`. `--json` prints the results as /readyz does.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from runtime.health import ERROR, WARNING, problems, run_checks


class Command(BaseCommand):
    help = "Check durability, workers, clocks, secrets and tool limits; exit 1 on a problem."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--fail-level", choices=[WARNING, ERROR], default=ERROR)
        parser.add_argument("--json", action="store_true", help="print every check's result")

    def handle(self, *args: Any, **options: Any) -> None:
        results = run_checks()
        found = problems(results)
        if options["json"]:
            self.stdout.write(json.dumps(results, indent=2, default=str, ensure_ascii=False))
        else:
            for level, check, line in found:
                self.stdout.write(f"{level.upper()} {check}: {line}")
        failing = [p for p in found if options["fail_level"] == WARNING or p[0] == ERROR]
        if failing:
            raise CommandError(f"{len(failing)} problem(s) found by {len(results)} checks")
        if not options["json"]:
            warned = len(found)
            self.stdout.write(
                f"{len(results)} checks: no errors, {warned} warning(s)."
                if warned
                else f"All {len(results)} checks pass."
            )
