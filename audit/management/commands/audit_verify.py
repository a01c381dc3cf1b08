"""Walk the journal's hash chains; exit 1 on the first broken link of any stream."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.apps import apps
from django.core.management.base import BaseCommand, CommandError, CommandParser

from audit.verification import check_anchor, verify_all


class Command(BaseCommand):
    help = "Verify journal chains (and optionally a signed anchor of stream heads)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--tenant", help="tenant slug: only its streams")
        parser.add_argument("--stream", help="one stream, e.g. run:<uuid> or tenant:<id>")
        parser.add_argument("--anchor", help="a file written by audit_anchor to check against")

    def handle(self, *args: Any, **options: Any) -> None:
        # An empty value names nothing: taken as the option left out, it verified the whole
        # journal and answered for a tenant or stream nobody named.
        for option, what in (("tenant", "tenant slug"), ("stream", "stream name")):
            if options[option] is not None and not options[option].strip():
                raise CommandError(f"--{option} needs a {what}")
        tenant_id = None
        if options["tenant"]:
            tenant = (
                apps.get_model("runtime", "Tenant").objects.filter(slug=options["tenant"]).first()
            )
            if tenant is None:
                raise CommandError(f"no tenant {options['tenant']!r}")
            tenant_id = tenant.pk
        checked, breaks = verify_all(tenant_id, options["stream"])
        for found in breaks:
            self.stdout.write(f"BROKEN {found.stream} at seq {found.seq}: {found.problem}")
        anchored = check_anchor(Path(options["anchor"])) if options["anchor"] else []
        for problem in anchored:
            self.stdout.write(f"ANCHOR {problem.stream} seq {problem.seq}: {problem.problem}")
        self.stdout.write(
            f"{checked} stream(s) checked, {len(breaks)} broken"
            + (f", {len(anchored)} anchor problem(s)" if options["anchor"] else "")
        )
        if breaks or anchored:
            raise CommandError("the journal does not verify")
        if options["stream"] and not checked:  # gone, or another tenant's: nothing proven
            raise CommandError(f"no stream {options['stream']!r} to verify")
