"""Tool definitions: a tenant's tools as data (API.md, "Tools as data").

A definition is append-only: a change is a new row with the next `version`, never an edit,
so an approval given for version 3 can always be held against what version 3 said, and the
history of what a tool was allowed to do is kept. The current definition of a name is its
highest version. The row keeps the definition exactly as validated (`spec`, canonical JSON
keys) and its digest; `runtime.tooldefs` is the only writer.
"""

from __future__ import annotations

from typing import Any

from django.db import models

from runtime.models.tenancy import Tenant


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
