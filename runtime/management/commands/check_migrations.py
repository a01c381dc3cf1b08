"""Dry-run graph migrations over every unfinished run; exit 1 if any would fail."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from runtime.versions import check_run, parked_runs


class Command(BaseCommand):
    help = "Report which unfinished runs could not resume on the registered graph versions."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--tenant", help="only this tenant's runs (slug)")
        parser.add_argument("--quiet", action="store_true", help="print only failures")

    def handle(self, *args: Any, **options: Any) -> None:
        total = failing = 0
        for run in parked_runs(options["tenant"]):
            verdict = check_run(run)
            total += 1
            failing += not verdict.ok
            if verdict.ok and options["quiet"]:
                continue
            mark = "ok  " if verdict.ok else "FAIL"
            self.stdout.write(
                f"{mark} {verdict.run_id} {verdict.graph}@{verdict.version}: {verdict.detail}"
            )
        self.stdout.write(f"{total} unfinished run(s) checked, {failing} would fail.")
        if failing:
            raise CommandError(f"{failing} run(s) would go to needs_attention")
