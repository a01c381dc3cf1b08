"""Recompute every checkpoint's digest against its row and its journal entry, and read every
artifact it reaches; exit 1 on anything that does not verify (runtime/checkverify.py)."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from django.core.management.base import BaseCommand, CommandError, CommandParser

from runtime.checkverify import runs, verify_checkpoints
from runtime.models import Tenant


class Command(BaseCommand):
    help = "Verify checkpoints against their journal entries, and the artifacts they reach."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--tenant", help="tenant slug: only its runs")
        parser.add_argument("--run", help="one run's id")

    def handle(self, *args: Any, **options: Any) -> None:
        # As audit_verify: an empty value names nothing, and is refused rather than taken
        # for the option left out (which would answer for every run).
        for option, what in (("tenant", "tenant slug"), ("run", "run id")):
            if options[option] is not None and not options[option].strip():
                raise CommandError(f"--{option} needs a {what}")
        tenant_id = None
        if options["tenant"]:
            tenant = Tenant.objects.filter(slug=options["tenant"]).first()
            if tenant is None:
                raise CommandError(f"no tenant {options['tenant']!r}")
            tenant_id = tenant.pk
        run_id = None
        if options["run"]:
            try:
                run_id = UUID(options["run"].strip())
            except ValueError:
                raise CommandError(f"--run {options['run']!r} is not a run id") from None
        checked_runs, checked, breaks = verify_checkpoints(
            runs(tenant_id, run_id), tenant_id=tenant_id, whole=run_id is None
        )
        for found in breaks:
            self.stdout.write(f"BROKEN run {found.run_id} checkpoint {found.rev}: {found.problem}")
        self.stdout.write(
            f"{checked_runs} run(s), {checked} checkpoint(s) checked, {len(breaks)} broken"
        )
        if breaks:
            raise CommandError("the checkpoints do not verify")
        if run_id is not None and not checked_runs:  # gone, or another tenant's
            raise CommandError(f"no run {options['run']!r} to verify")
