"""Tool definitions: a tenant's tools as data (API.md, "Tools as data").

A definition is append-only: a change is a new row with the next `version`, never an edit,
so an approval given for version 3 can always be held against what version 3 said, and the
history of what a tool was allowed to do is kept. The current definition of a name is its
highest version. The row keeps the definition exactly as validated (`spec`, canonical JSON
keys) and its digest; `runtime.tooldefs` is the only writer.
"""

from __future__ import annotations

import math
from typing import Any

from django.db import models

from runtime.models.tenancy import Tenant

# How long one request of a tool may take (`timeout_seconds`), for every way a timeout is
# given: a definition (API, admin, file, built-in) and an upstream MCP server, whose tools
# get its timeout. Below MIN_TIMEOUT a request cannot finish — a connection, the request and
# the answer over anything but loopback, an MCP session's handshake before its call — so every
# action would end `unknown` and wait for reconciliation (a person, for dedup `none`). Above
# MAX_TIMEOUT a call outlives any sensible lease (`doctor` checks the configured TTL).
MIN_TIMEOUT = 0.1
MAX_TIMEOUT = 60.0


def timeout_problem(value: Any) -> str | None:
    """Why `value` cannot be a tool's `timeout_seconds`, or None when it can. NaN and the
    infinities are refused by name: a comparison alone would let a NaN through some day."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "a number of seconds"
    if not math.isfinite(value) or not MIN_TIMEOUT <= value <= MAX_TIMEOUT:
        return f"between {MIN_TIMEOUT:g} and {MAX_TIMEOUT:g} seconds"
    return None


class ToolDefinition(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="tool_definitions")
    name = models.CharField(max_length=100)
    version = models.PositiveIntegerField()
    spec = models.JSONField(help_text="The definition as validated (API.md, Tools as data).")
    digest = models.CharField(max_length=64, help_text="SHA-256 of the canonical spec.")
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.CharField(max_length=200, blank=True)

    class Meta:
        ordering = ["tenant__slug", "name", "-version"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "name", "version"], name="runtime_tooldefinition_version"
            ),
            models.CheckConstraint(
                condition=models.Q(version__gte=1), name="runtime_tooldefinition_version_gte_1"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} v{self.version}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Versions are append-only: a saved definition is never rewritten."""
        if not self._state.adding:
            raise ValueError("a tool definition version is never changed; define a new one")
        super().save(*args, **kwargs)

    def delete(self, *args: Any, **kwargs: Any) -> tuple[int, dict[str, int]]:
        raise ValueError("tool definition versions are kept (actions and approvals cite them)")
