"""System checks for configuration that would silently weaken a guarantee."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Warning, register


@register()
def check_sqlite_durability(app_configs: Any, **kwargs: Any) -> list[CheckMessage]:
    db = settings.DATABASES["default"]
    if db["ENGINE"] != "django.db.backends.sqlite3":
        return []
    init = db.get("OPTIONS", {}).get("init_command", "")
    if "synchronous=FULL" not in init:
        return [
            Warning(
                "SQLite without synchronous=FULL can lose the last commits on power loss.",
                hint="A lost `sent` mark would let `prepared` lie; keep synchronous=FULL.",
                id="holdpoint.W001",
            )
        ]
    return []
