"""Apply retention: purge finished runs past their tenant's retention (or one thread)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from runtime.api.idempotency import expire_keys
from runtime.models import Tenant
from runtime.retention import purge


class Command(BaseCommand):
    help = "Remove run data past retention; journal chains keep verifying (payload digests)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--dry-run", action="store_true", help="say what would go")
        parser.add_argument("--tenant", help="only this tenant (slug)")
        parser.add_argument(
            "--thread",
            help="delete this thread's finished runs now (a deletion request); needs --tenant",
        )
        parser.add_argument(
            "--batch-size",
            type=int,
            help="runs per transaction (default HOLDPOINT_PURGE_BATCH)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["tenant"] is not None and not options["tenant"].strip():
            # An empty slug is no tenant: taken as "no --tenant", it purged every tenant.
            raise CommandError("--tenant needs a tenant slug")
        if options["thread"] is not None and not options["thread"].strip():
            # An empty id is no thread: taken as "no --thread", it purged every tenant.
            raise CommandError("--thread needs a thread id")
        if options["thread"] and not options["tenant"]:
            raise CommandError("--thread needs --tenant")
        if options["batch_size"] is not None and options["batch_size"] < 1:
            raise CommandError("--batch-size must be at least 1")
        try:
            reports = purge(
                dry_run=options["dry_run"],
                tenant_slug=options["tenant"],
                thread_id=options["thread"],
                batch_size=options["batch_size"],
            )
        except Tenant.DoesNotExist as exc:
            raise CommandError(str(exc)) from None
        verb = "would purge" if options["dry_run"] else "purged"
        if not options["thread"]:
            keys = expire_keys(dry_run=options["dry_run"])
            self.stdout.write(f"{verb} {keys} expired Idempotency-Key response(s)")
        for report in reports:
            self.stdout.write(
                f"{report.tenant}: {verb} {len(report.runs)} run(s), "
                f"{report.checkpoints} checkpoint(s), {report.artifacts} artifact(s), "
                f"{report.entries_redacted} journal payload(s) redacted"
            )
            kept = "would keep" if options["dry_run"] else "KEPT"
            for run_id, why in report.held.items():
                self.stdout.write(f"{report.tenant}: {kept} run {run_id}: journal {why}")
        held = sum(len(report.held) for report in reports)
        if held:  # the other tenants and runs went; this still needs a person
            raise CommandError(
                f"{held} due run(s) {'would be ' if options['dry_run'] else ''}kept: their "
                "journal cannot be redacted (edited?); see audit_verify"
            )
