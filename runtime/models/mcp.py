"""A tenant's upstream MCP servers: where the tools of `executor: mcp` definitions are sent.

A tool definition names its server (`mcp.server`); the row says how to reach it. Streamable
HTTP upstreams are held to the same outbound rules as http tools (HOLDPOINT_TOOL_HOSTS, no
private addresses unless allowed): the URL is checked when the row is saved and again, with
the name resolved, before every connection. A `stdio` upstream is a command the Holdpoint
process itself starts, on its own host, with its environment: whoever can register one can
run code on the operator's machine. So it is refused unless the operator turned
HOLDPOINT_MCP_STDIO on — for a local, single-user setup, never for a shared deployment.
"""

from __future__ import annotations

import re
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models

from runtime.models.tenancy import Tenant
from runtime.models.tooldefs import timeout_problem

# `\Z`, not `$`: `$` also matches before a final "\n", which neither may end in.
SERVER_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,39}\Z")
SERVICE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}\Z")


class McpTransport(models.TextChoices):
    STREAMABLE_HTTP = "streamable_http", "streamable HTTP (URL)"
    STDIO = "stdio", "stdio (a local command; only with HOLDPOINT_MCP_STDIO)"


# The fields that say where a server is reached.
ADDRESS = ("transport", "url", "command", "args")


class McpServer(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="mcp_servers")
    name = models.CharField(
        max_length=40,
        help_text="Lower-case, e.g. helpdesk: imported tools are named helpdesk.<tool>.",
    )
    transport = models.CharField(
        max_length=20, choices=McpTransport.choices, default=McpTransport.STREAMABLE_HTTP
    )
    url = models.CharField(
        max_length=500, blank=True, help_text="streamable HTTP: the endpoint, e.g. https://x/mcp"
    )
    command = models.CharField(max_length=500, blank=True, help_text="stdio: the program")
    args = models.JSONField(default=list, blank=True, help_text="stdio: its arguments (a list)")
    credential = models.CharField(
        max_length=64,
        blank=True,
        help_text="The tenant's tool credential (service name) sent as a bearer token.",
    )
    timeout_seconds = models.FloatField(
        default=10.0, help_text="How long one call may take; imported tools get this timeout."
    )
    active = models.BooleanField(default=True, help_text="Inactive: its tools are not sent.")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "MCP server"
        ordering = ["tenant__slug", "name"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name"], name="runtime_mcpserver_name"),
        ]

    def __str__(self) -> str:
        return f"MCP server {self.name}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Every writer (admin, shell, tests) gets the checks of `clean`."""
        self.full_clean()
        super().save(*args, **kwargs)

    def clean(self) -> None:
        """Refuse a row its tools could not be sent to (or must not be)."""
        from runtime import outbound

        errors: dict[str, list[str]] = {}
        if not SERVER_NAME.match(self.name or ""):
            errors.setdefault("name", []).append("lower-case letters, digits, _ and -")
        if self.credential and not SERVICE.match(self.credential):
            errors.setdefault("credential", []).append("a credential's service name, e.g. tasks")
        if trouble := timeout_problem(self.timeout_seconds):
            errors.setdefault("timeout_seconds", []).append(trouble)
        if self.transport == McpTransport.STREAMABLE_HTTP:
            try:
                outbound.check_url(self.url)
            except outbound.OutboundRefused as exc:
                errors.setdefault("url", []).append(exc.detail)
        else:
            if not settings.HOLDPOINT_MCP_STDIO:
                errors.setdefault("transport", []).append(
                    "stdio servers are off (HOLDPOINT_MCP_STDIO): they run a command on "
                    "Holdpoint's own host"
                )
            if not self.command:
                errors.setdefault("command", []).append("stdio needs a command")
            if not isinstance(self.args, list) or not all(isinstance(a, str) for a in self.args):
                errors.setdefault("args", []).append("a list of strings")
        if self.pk is not None:
            # Where a server is reached is part of what its tools' approvals were given
            # for, and the definitions name the server, not the address: a server that
            # moves is a new server (register it, import its tools: new definitions).
            before = McpServer.objects.filter(pk=self.pk).values(*ADDRESS).first()
            for field in ADDRESS:
                if before is not None and before[field] != getattr(self, field):
                    errors.setdefault(field, []).append(
                        "fixed once registered: register the moved server under a new name"
                    )
        if errors:
            raise ValidationError(errors)
