"""Export every stream head, signed, to a file kept outside the database."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.utils import timezone

from audit.verification import anchor


class Command(BaseCommand):
    help = "Write signed stream heads (seq, hash) for truncation/rewrite detection."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--out", help="file to write (default var/anchors/<time>.anchor)")

    def handle(self, *args: Any, **options: Any) -> None:
        from django.conf import settings

        path = Path(
            options["out"]
            or settings.VAR_DIR / "anchors" / f"{timezone.now():%Y%m%dT%H%M%S}.anchor"
        )
        count = anchor(path)
        self.stdout.write(f"{count} stream head(s) anchored in {path}")
