"""Dry-run graph migrations over every unfinished run; exit 1 if any would fail."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from runtime.versions import check_run, parked_runs


class Command(BaseCommand):
    help = (
        "Report which unfinished runs could not resume on the registered graph versions, "
        "and which would be migrated in the middle of an action."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--tenant", help="only this tenant's runs (slug)")
        parser.add_argument(
            "--quiet", action="store_true", help="print only failures and mid-action runs"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        total = failing = mid = 0
        for run in parked_runs(options["tenant"]):
            verdict = check_run(run)
            total += 1
            failing += not verdict.ok
            mid += bool(verdict.ok and verdict.mid_action)
            if verdict.ok and not verdict.mid_action and options["quiet"]:
                continue
            mark = "FAIL" if not verdict.ok else "MID " if verdict.mid_action else "ok  "
            self.stdout.write(
                f"{mark} {verdict.run_id} {verdict.graph}@{verdict.version}: {verdict.detail}"
            )
        self.stdout.write(
            f"{total} unfinished run(s) checked, {failing} would fail, "
            f"{mid} would be migrated mid-action."
        )
        if failing:
            raise CommandError(f"{failing} run(s) would go to needs_attention")
