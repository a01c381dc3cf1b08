"""`manage.py tools import FILE|export|list --tenant SLUG`: a tenant's tools as files.

import  FILE (JSON: one definition or a list) all or nothing: every tool of the file is
        validated first; on any error the errors are printed, one per line, nothing is
        stored and the exit status is 1. Otherwise one line per tool: `created vN` (a new
        version) or `unchanged vN` (the same definition is already current).
export  the current definitions as a JSON list (stdout, or --output FILE): importing it
        again changes nothing.
import-mcp --server NAME: the tools the tenant's upstream MCP server lists, each stored as
        an `executor: mcp` definition (`unchanged vN` when it did not change); a person's
        corrections of an imported tool are kept (runtime.mcpimport.reimported). A tool of the
        tenant's sent to that server whose upstream tool it no longer lists is named too
        (`no longer listed by NAME`): it stays defined (nothing retires one tool).
list    name, version, effect, executor, dedup and approval note of every tool the tenant
        may use, built-ins included.

Each stored version is journalled in the tenant's stream (runtime.tooldefs.define).
"""

from __future__ import annotations

import getpass
import json
import sys
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from audit.canonical import parse_strict
from runtime import toolcatalog, tooldefs
from runtime.models import Tenant


def _os_user() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):
        return "unknown"


class Command(BaseCommand):
    help = "Import, export or list a tenant's tool definitions."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=["import", "import-mcp", "export", "list"])
        parser.add_argument("file", nargs="?", help="import: the JSON file (- for stdin)")
        parser.add_argument("--tenant", required=True, help="tenant slug")
        parser.add_argument("--server", help="import-mcp: the upstream MCP server's name")
        parser.add_argument("--output", help="export: write to this file instead of stdout")

    def handle(self, *args: Any, **options: Any) -> None:
        tenant = Tenant.objects.filter(slug=options["tenant"]).first()
        if tenant is None:
            raise CommandError(f"no tenant {options['tenant']!r}")
        getattr(self, f"do_{options['action'].replace('-', '_')}")(tenant, options)

    def do_import(self, tenant: Tenant, options: dict[str, Any]) -> None:
        source = options["file"]
        if not source:
            raise CommandError("import needs a FILE (JSON: one definition or a list)")
        try:
            text = sys.stdin.read() if source == "-" else Path(source).read_text("utf-8")
        except OSError as exc:
            raise CommandError(f"cannot read {source}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:  # JSON is UTF-8 (RFC 8259); no OSError
            raise CommandError(f"{source} is not UTF-8: byte {exc.start} ({exc.reason})") from None
        try:
            data = parse_strict(text)  # as the API parses it: no duplicate keys, NaN, depth
        except ValueError as exc:
            raise CommandError(f"{source} is not JSON: {exc}") from None
        actor = f"system:tools import ({_os_user()})"
        try:
            defined = toolcatalog.import_definitions(tenant, data, actor)
        except (tooldefs.InvalidTool, tooldefs.HostNotAllowed) as exc:
            for where, messages in (exc.extra.get("errors") or {}).items():
                for message in messages:
                    self.stderr.write(f"{where}: {message}")
            raise CommandError(f"{exc.code}: {exc.detail}; nothing was stored") from None
        for item in defined:
            row = item.definition
            state = "created" if item.created else "unchanged"
            self.stdout.write(f"{row.name}: {state} v{row.version}")

    def do_import_mcp(self, tenant: Tenant, options: dict[str, Any]) -> None:
        from runtime import mcpimport
        from runtime.errors import HoldpointError
        from runtime.models import McpServer

        server = McpServer.objects.filter(tenant=tenant, name=options["server"] or "").first()
        if server is None:
            raise CommandError(f"no MCP server {options['server']!r} for tenant {tenant.slug}")
        try:
            imported = mcpimport.import_tools(server, f"system:tools import-mcp ({_os_user()})")
        except HoldpointError as exc:
            for where, messages in (exc.extra.get("errors") or {}).items():
                for message in messages:
                    self.stderr.write(f"{where}: {message}")
            raise CommandError(f"{exc.code}: {exc.detail}; nothing was stored") from None
        for item in imported.tools:
            row = item.definition
            self.stdout.write(
                f"{row.name}: {'created' if item.created else 'unchanged'} v{row.version}"
            )
        for name in imported.unlisted:
            self.stdout.write(
                f"{name}: no longer listed by {server.name}: kept as defined and still "
                "offered to agents (the server refuses a tool it does not have)"
            )

    def do_export(self, tenant: Tenant, options: dict[str, Any]) -> None:
        text = json.dumps(
            toolcatalog.export_definitions(tenant.pk), indent=2, sort_keys=True, ensure_ascii=False
        )
        if options["output"]:
            target = Path(options["output"])
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text + "\n", "utf-8")
            except OSError as exc:
                raise CommandError(f"cannot write {target}: {exc.strerror}") from None
            count = len(tooldefs.current_definitions(tenant.pk))
            self.stdout.write(f"{count} tool(s) written to {options['output']}")
        else:
            self.stdout.write(text)

    def do_list(self, tenant: Tenant, options: dict[str, Any]) -> None:
        for entry in toolcatalog.entries(tenant.pk):
            spec = entry.spec
            origin = "built-in" if entry.builtin else f"v{entry.version}"
            note = "  needs approval by default" if entry.approval_by_default else ""
            self.stdout.write(
                f"{entry.name}  {origin}  {spec.get('effect', '')}  "
                f"{spec.get('executor', '')}  dedup={(spec.get('dedup') or {}).get('mode', '')}"
                f"{note}"
            )
