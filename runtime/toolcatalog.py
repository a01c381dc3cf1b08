"""What a tenant's tools look like to the people and agents who use them (API.md, "Tools as
data"): the built-in tools and the tenant's current definitions in one list, whether each
would wait for a reviewer by default, a dry run of one, and the file format of import and
export.

The API (`GET tools/`), Django admin and `manage.py tools` all read through here, so the
three agree on what "the tenant's tools" are; what an agent is offered now (`offered`,
`withheld`: not an inactive MCP server's tools) is decided here for the API, the MCP
gateway and the workers' steps alike. Nothing here writes a definition:
`runtime.tooldefs.define` is the one writer, and `import_definitions` only calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import OuterRef, Subquery

from runtime import gates, tooldefs, tools, urltemplates
from runtime.errors import InvalidParams, NotFound, VersionConflict
from runtime.models import McpServer, Tenant, ToolCredential, ToolDefinition

BUILTIN_VERSION = 1
MAX_VERSION = (
    2**31 - 1
)  # the column's range  # a built-in tool changes with the code, not by definition edits


@dataclass(frozen=True)
class Entry:
    """One tool as listed: its spec (the definition's fields) and where it comes from."""

    name: str
    version: int
    builtin: bool
    spec: dict[str, Any]
    approval_by_default: bool
    digest: str = ""
    created_at: datetime | None = None
    created_by: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.spec,
            "name": self.name,
            "version": self.version,
            "builtin": self.builtin,
            "approval_by_default": self.approval_by_default,
            "digest": self.digest,
            "created_at": self.created_at,
            "created_by": self.created_by,
        }


def needs_approval_by_default(spec: Mapping[str, Any], named: set[str]) -> bool:
    """Safe by default: a tenant's tool that changes something waits for a reviewer until a
    policy names it (and then the policy decides)."""
    return tools.changes_something(spec) and spec.get("name") not in named


def _from_row(row: ToolDefinition, named: set[str]) -> Entry:
    return Entry(
        name=row.name,
        version=row.version,
        builtin=False,
        spec=dict(row.spec),
        approval_by_default=needs_approval_by_default(row.spec, named),
        digest=row.digest,
        created_at=row.created_at,
        created_by=row.created_by,
    )


def _builtin(name: str, spec: Mapping[str, Any]) -> Entry:
    return Entry(
        name=name,
        version=BUILTIN_VERSION,
        builtin=True,
        spec=dict(spec),
        approval_by_default=False,  # built-ins follow their code and the tenant's policies
        digest=tooldefs.digest(spec),
    )


def entries(tenant_id: int) -> list[Entry]:
    """Every tool the tenant may use, by name: the built-ins, then its own definitions (a
    definition of a built-in's name is what the tenant gets, so it is what is listed)."""
    named = gates.tools_named_by_policy(tenant_id)
    found = {name: _builtin(name, spec) for name, spec in tooldefs.builtin_specs().items()}
    for row in tooldefs.current_definitions(tenant_id):
        found[row.name] = _from_row(row, named)
    return [found[name] for name in sorted(found)]


def entry(tenant_id: int, name: str, version: int | None = None) -> Entry | None:
    """One tool of the tenant (an older version on request), or None: another tenant's
    definition is not found here, like a name nobody defined."""
    if not tooldefs.NAME.match(name) or (version is not None and not 1 <= version <= MAX_VERSION):
        return None  # not a name or version any tool has (and nothing for the database)
    rows = ToolDefinition.objects.filter(tenant_id=tenant_id, name=name)
    row = (
        rows.filter(version=version) if version is not None else rows.order_by("-version")
    ).first()
    if row is not None:
        return _from_row(row, gates.tools_named_by_policy(tenant_id))
    spec = tooldefs.builtin_specs().get(name)
    if spec is None or version not in (None, BUILTIN_VERSION):
        return None
    return _builtin(name, spec)


def active_servers(tenant_id: int) -> set[str]:
    """The names of the tenant's active MCP servers: only their tools are sent."""
    found = McpServer.objects.filter(tenant_id=tenant_id, active=True)
    return set(found.values_list("name", flat=True))


def _server_of(tool: tools.Tool | Mapping[str, Any]) -> str:
    if isinstance(tool, tools.Tool):
        return tool.mcp_server
    if tool.get("executor") != tools.Sender.MCP:
        return ""
    return str((tool.get("mcp") or {}).get("server", ""))


def withheld(
    tool: tools.Tool | Mapping[str, Any], tenant_id: int, active: set[str] | None = None
) -> str:
    """The inactive (or removed) MCP server whose tool this is — a tool, or a definition's
    spec — else "". Such a tool is not sent (runtime.mcp), so nobody is offered it: not
    listed by the API or the MCP gateway, not found by name, no new action prepared (an
    approval asked for it would be wasted on a reviewer), and an action prepared before not
    marked sent (runtime.ledger.mark_sent: it waits, approved). The one rule all of them follow;
    past actions of it stay readable. `active`: `active_servers`, when already read; only
    an MCP tool reads it (any other tool costs no statement)."""
    server = _server_of(tool)
    if not server or server in (active if active is not None else active_servers(tenant_id)):
        return ""
    return server


def withheld_by_name(tenant_id: int, names: Iterable[str]) -> dict[str, str]:
    """`withheld` for tools named, each judged by its current definition (the version a send
    uses): {name: its inactive server} for those withheld, nothing for the rest. Two
    statements at most however many names — the reviewers' inbox asks it for all its cards
    at once — and only the first when none of them is an MCP tool."""
    wanted = sorted(set(names))
    if not wanted:
        return {}
    newest = ToolDefinition.objects.filter(tenant_id=tenant_id, name=OuterRef("name"))
    rows = ToolDefinition.objects.filter(
        tenant_id=tenant_id,
        name__in=wanted,
        version=Subquery(newest.order_by("-version").values("version")[:1]),
    )
    specs = {name: spec for name, spec in rows.values_list("name", "spec") if _server_of(spec)}
    if not specs:
        return {}
    active = active_servers(tenant_id)
    found = {name: withheld(spec, tenant_id, active) for name, spec in specs.items()}
    return {name: server for name, server in found.items() if server}


def offered(tenant_id: int) -> list[Entry]:
    """`entries` an agent may use now: without the tools `withheld`."""
    every = entries(tenant_id)
    if not any(_server_of(e.spec) for e in every):
        return every
    active = active_servers(tenant_id)
    return [e for e in every if not withheld(e.spec, tenant_id, active)]


def offered_entry(tenant_id: int, name: str, version: int | None = None) -> Entry | None:
    """`entry`, or None for a tool `withheld` now, as for a name nobody defined (judged by
    its current definition: what a new action would be prepared with)."""
    found = entry(tenant_id, name, version)
    current = found if version is None or found is None else entry(tenant_id, name)
    if current is None or withheld(current.spec, tenant_id):
        return None
    return found


def refuse_withheld(tool: tools.Tool, tenant_id: int) -> None:
    """A new action of a tool `withheld`: refused as an unknown tool is — 422 over the API,
    the same InvalidParams out of a hosted step's `ctx.act` (the run then needs attention)."""
    server = withheld(tool, tenant_id)
    if server:
        raise InvalidParams(
            f"unknown tool {tool.name!r}: its MCP server {server!r} is inactive",
            errors={"tool": ["unknown tool"]},
        )


def versions(tenant_id: int, name: str) -> list[ToolDefinition]:
    """A definition's history, newest first (approvals cite the version they were given for)."""
    return list(ToolDefinition.objects.filter(tenant_id=tenant_id, name=name).order_by("-version"))


@dataclass(frozen=True)
class DryRun:
    """The request a tool would send for some params, credential masked; nothing was sent."""

    executor: str
    method: str = ""
    url: str = ""
    headers: dict[str, str] | None = None
    body: str = ""


DRY_RUN_KEY = "dry-run"
MASK = "********"


def dry_run(tenant_id: int, name: str, params: Any, version: int | None = None) -> DryRun:
    """Validate `params` against the tool's schema (InvalidParams with field errors) and
    build — never send — the request Holdpoint would make for them.

    A `client` tool is performed by the agent: there is no request of Holdpoint's to show.
    The credential is the tenant's (a dry run has no run to find it by), shown masked."""
    tool = tools.get_tool(
        name, tenant_id=tenant_id, version=str(version) if version is not None else None
    )
    if not isinstance(params, dict):
        raise InvalidParams("params are a JSON object", errors={"params": ["a JSON object"]})
    tool.validate(params)
    if not isinstance(tool, tools.HttpTool):
        return DryRun(executor=tool.executor)
    # Params the schema takes may still not fit the URL (a placeholder left out, an object,
    # ".."): the send refuses them (HttpTool.call), and the dry run says why.
    try:
        request = tool.build_request(
            params, key=DRY_RUN_KEY, fence=0, run_id=DRY_RUN_KEY, reveal=False
        )
    except urltemplates.TemplateError as exc:
        reason = f"the URL cannot be built: {exc}"
        raise InvalidParams(reason, errors={"params": [reason]}) from None
    headers = dict(request.headers)
    if tool.credential:
        stored = ToolCredential.objects.filter(tenant_id=tenant_id, service=tool.credential).first()
        headers["Authorization"] = (
            f"Bearer {MASK} (the tenant's {tool.credential!r} credential)"
            if stored is not None and stored.is_set
            else f"(none: the tenant has no {tool.credential!r} credential yet)"
        )
    return DryRun(
        executor=tool.executor,
        method=request.method,
        url=str(request.url),
        headers=headers,
        body=request.content.decode("utf-8", "replace"),
    )


def create(
    tenant: Tenant, data: Any, actor: str, settle: Callable[[Any, bool], None] | None = None
) -> ToolDefinition:
    """A new tool (`POST tools/`): 409 `tool_exists` for a name the tenant already defined
    (a definition of a built-in's name is allowed: the tenant's own takes precedence).
    `settle`: see tooldefs.define."""
    return tooldefs.define(tenant, data, actor, create_only=True, settle=settle).definition


def revise(tenant: Tenant, name: str, data: Any, actor: str) -> ToolDefinition:
    """The next version of one of the tenant's tools (`PUT tools/{name}/`), if the caller
    saw the current one: `expected_version` is compared under the lock `define` takes, so
    two admins editing at once do not overwrite each other unseen (409 version_conflict)."""
    if not isinstance(data, Mapping):
        raise tooldefs.InvalidTool(
            "a tool definition is a JSON object", errors={"tool": ["not an object"]}
        )
    body = dict(data)
    expected = body.pop("expected_version", None)
    errors: dict[str, list[str]] = {}
    if isinstance(expected, bool) or not isinstance(expected, int) or expected < 1:
        errors["expected_version"] = ["the version this change replaces (an integer)"]
    if body.setdefault("name", name) != name:
        errors["name"] = [f"the name in the URL: {name}"]
    with transaction.atomic():
        Tenant.objects.select_for_update().filter(pk=tenant.pk).first()
        latest = tooldefs.current(tenant.pk, name)
        if latest is None:
            raise NotFound()  # a built-in, or nothing: no definition of the tenant to revise
        if errors:
            raise tooldefs.InvalidTool("the change is invalid", errors=errors)
        if latest.version != expected:
            raise VersionConflict(
                f"{name} is at version {latest.version}, not {expected}",
                current_version=latest.version,
            )
        return tooldefs.define(tenant, body, actor).definition


def known_names(tenant: Tenant) -> set[str]:
    """Names a definition of the tenant may cite as its compensation."""
    return set(tools.tenant_tool_names(tenant.pk)) | set(tools.builtin_names())


def export_definitions(tenant_id: int) -> list[dict[str, Any]]:
    """The tenant's current definitions in the import format: importing them again changes
    nothing (each is its stored, normalised spec, whose digest is what `define` compares)."""
    return [dict(row.spec) for row in tooldefs.current_definitions(tenant_id)]


def import_definitions(tenant: Tenant, data: Any, actor: str) -> list[tooldefs.Defined]:
    """A file's tools (one object or a list), all or nothing (`tooldefs.define_many`).

    Every item is checked first, so a refusal lists the errors of the whole file, each
    under the tool it belongs to (`tickets.create: dedup.mode`), not only the first one's."""
    items = data if isinstance(data, list) else [data]
    if not items:
        raise tooldefs.InvalidTool("the file defines no tool", errors={"file": ["empty list"]})
    names = [item.get("name") for item in items if isinstance(item, Mapping)]
    known = {n for n in names if isinstance(n, str)} | known_names(tenant)
    invalid: dict[str, list[str]] = {}
    hosts: dict[str, list[str]] = {}
    for number, item in enumerate(items, start=1):
        name = item.get("name") if isinstance(item, Mapping) else None
        label = name if isinstance(name, str) and name else f"#{number}"
        if isinstance(name, str) and names.count(name) > 1:
            invalid.setdefault(f"{label}: name", []).append("defined more than once in the file")
        try:
            tooldefs.parse(item, known_tools=known, tenant_id=tenant.pk)
        except tooldefs.InvalidTool as exc:
            for field, messages in (exc.extra.get("errors") or {}).items():
                invalid.setdefault(f"{label}: {field}", []).extend(messages)
        except tooldefs.HostNotAllowed as exc:
            for field, messages in (exc.extra.get("errors") or {}).items():
                hosts.setdefault(f"{label}: {field}", []).extend(messages)
    if invalid:
        raise tooldefs.InvalidTool(
            f"{len(invalid)} field(s) of the file are invalid", errors={**invalid, **hosts}
        )
    if hosts:
        raise tooldefs.HostNotAllowed(
            "a tool would send requests to a host not allowed", errors=hosts
        )
    return tooldefs.define_many(tenant, items, actor)
