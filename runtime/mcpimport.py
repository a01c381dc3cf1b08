"""Importing an upstream MCP server's tools as definitions (API.md, "Tools as data"; issue
19): its `tools/list`, every page, each tool turned into an `executor: mcp` definition and
stored all or nothing (`toolcatalog.import_definitions`). A re-import keeps what a person
corrected since (`reimported`); the upstream's word is taken only where it changed.

The session itself (reaching the server under the rules of http tools, the SDK run from
synchronous code) is runtime.mcp's, which also sends the imported tools' calls.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
from mcp import Client
from mcp_types import Tool as UpstreamTool

from audit.canonical import digests
from runtime import outbound
from runtime.crypto import Secret, SecretUnreadable
from runtime.errors import HoldpointError
from runtime.mcp import describe, run_session, target_for
from runtime.models import McpServer, ToolCredential
from runtime.tools import Effect

if TYPE_CHECKING:
    from runtime.tooldefs import Defined

MAX_TOOLS = 500  # one import; an upstream listing more is refused, not truncated


class UpstreamUnavailable(HoldpointError):
    """The upstream could not be asked (refused connection, failed handshake, timeout)."""

    code = "upstream_unavailable"
    status = 502
    title = "The MCP server could not be reached"


def _secret(server: McpServer) -> Secret | None:
    return ToolCredential.lookup(server.tenant_id, server.credential) if server.credential else None


def fetch_tools(server: McpServer) -> list[UpstreamTool]:
    """The server's `tools/list`, every page. HostNotAllowed before any connection;
    UpstreamUnavailable if it cannot be asked."""
    from runtime.tooldefs import HostNotAllowed

    try:
        target = target_for(server, _secret(server))
    except outbound.OutboundRefused as exc:
        if exc.code == "bad_header":
            raise UpstreamUnavailable(f"{server.name}: {exc.detail}") from None
        raise HostNotAllowed(exc.detail, errors={"url": [exc.detail]}) from None
    except (httpx.ConnectError, SecretUnreadable) as exc:
        raise UpstreamUnavailable(f"{server.name}: {exc}") from None

    async def listing(client: Client) -> list[UpstreamTool]:
        found: list[UpstreamTool] = []
        cursor: str | None = None
        while True:
            page = await client.list_tools(cursor=cursor)
            found.extend(page.tools)
            cursor = page.next_cursor
            if not cursor or len(found) > MAX_TOOLS:
                return found

    try:
        tools = run_session(target, listing)
    except BaseException as exc:  # noqa: BLE001 (whatever the SDK raised: not reached)
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise UpstreamUnavailable(f"{server.name}: {describe(exc)}") from None
    if len(tools) > MAX_TOOLS:
        raise UpstreamUnavailable(f"{server.name} lists more than {MAX_TOOLS} tools")
    return tools


_NOT_NAME = re.compile(r"[^a-z0-9_-]+")


def definition_name(server: str, tool: str) -> str:
    """`<server>.<tool>` within the definition name rules: lower case, anything else `_`."""
    part = _NOT_NAME.sub("_", tool.lower()).strip("_-")
    if not part or not part[0].isalpha():
        part = f"t_{part}".rstrip("_")
    return f"{server}.{part}"[:100]


def effect_of(tool: UpstreamTool) -> str:
    """From the upstream's hints (which are its word, not proof: an admin reviews them)."""
    hints = tool.annotations
    if hints is not None and hints.read_only_hint:
        return Effect.READ
    if hints is not None and hints.destructive_hint:
        return Effect.IRREVERSIBLE
    return Effect.WRITE


def definition_of(server: McpServer, tool: UpstreamTool) -> dict[str, Any]:
    """The definition an upstream tool is imported as (validated by `tooldefs.parse`)."""
    title = (tool.annotations.title if tool.annotations else None) or tool.title or ""
    spec: dict[str, Any] = {
        "name": definition_name(server.name, tool.name),
        "description": (tool.description or "")[:2000],
        # A reviewer's card title; braces would be placeholders, and the upstream's text
        # is no template.
        "title": re.sub(r"[{}]", "", title)[:300],
        "effect": effect_of(tool),
        "schema": dict(tool.input_schema),
        "executor": "mcp",
        "mcp": {"server": server.name, "tool": tool.name},
        "dedup": {"mode": "none"},
        "timeout_seconds": server.timeout_seconds,
    }
    if server.credential:
        spec["credential"] = server.credential
    return spec


# What an import takes from the upstream's listing (and the server's own settings); every
# other field of an imported definition is a person's to set (README, "MCP upstreams").
FROM_UPSTREAM = ("title", "description", "effect", "schema", "timeout_seconds", "credential")
# The fields a person sets on an imported tool, which a re-import never changes (those that
# name schema properties lose the names the upstream's new schema no longer has).
BY_A_PERSON = (
    "editable",
    "sensitive",
    "dedup",
    "lookup",
    "result",
    "compensation",
    "compensation_param",
)


def said_by_upstream(
    spec: Mapping[str, Any], before: Mapping[str, Any] | None = None
) -> dict[str, str]:
    """A short digest of each FROM_UPSTREAM field of a definition as the upstream gave it:
    recorded in `mcp.imported`, so the next import can tell what the upstream changed since
    from what a person changed. The digest recorded `before` (the last import's) of a field
    the upstream did not change is kept as it was: recorded before Holdpoint wrote RFC 8785,
    it may be of the earlier form (audit.canonical.digests), and the same field must not
    pass for a changed one — nor its record, rewritten, make the same definition a new
    version."""
    said = {}
    for f in FROM_UPSTREAM:
        forms = [d[:16] for d in digests(spec.get(f, ""))]
        kept = (before or {}).get(f)
        said[f] = kept if isinstance(kept, str) and kept in forms else forms[0]
    return said


def reimported(fresh: dict[str, Any], current: Mapping[str, Any] | None) -> dict[str, Any]:
    """The definition an import stores for an upstream tool (`fresh`: `definition_of`) over
    the tenant's current one. A first import is `fresh` as it is. Again, a person's
    corrections stay: each FROM_UPSTREAM field is the upstream's only if the upstream changed
    it since the last import (its digest in `mcp.imported` differs; a definition imported
    before that record existed takes the upstream's), every BY_A_PERSON field and
    `mcp.key_argument` is the current definition's — the key argument taken out of the
    upstream's schema, as the definition rules require, and `editable`/`sensitive` kept to
    the properties the schema still has."""
    if current is None or current.get("executor") != "mcp":
        return {**fresh, "mcp": {**fresh["mcp"], "imported": said_by_upstream(fresh)}}
    before = (current.get("mcp") or {}).get("imported") or {}
    said = said_by_upstream(fresh, before)
    merged = {f: current[f] for f in BY_A_PERSON if f in current}
    for f in FROM_UPSTREAM:
        changed = before.get(f) != said[f]
        merged[f] = fresh.get(f, "") if changed or f not in current else current[f]
    key_argument = str((current.get("mcp") or {}).get("key_argument", ""))
    merged["schema"] = _without(merged["schema"], key_argument)
    properties = merged["schema"].get("properties") or {}
    for f in ("editable", "sensitive"):
        merged[f] = [name for name in merged.get(f, []) if name in properties]
    merged["mcp"] = {**fresh["mcp"], "imported": said}
    if key_argument:
        merged["mcp"]["key_argument"] = key_argument
    return {"name": fresh["name"], "executor": "mcp", **merged}


def _imported_from(spec: Mapping[str, Any], server: McpServer) -> bool:
    """Whether a definition is a tool of `server` (imported, or corrected since)."""
    return spec.get("executor") == "mcp" and (spec.get("mcp") or {}).get("server") == server.name


def _without(schema: Any, argument: str) -> Any:
    """`schema` without the property `argument` (Holdpoint fills it: no param may name it)."""
    if not argument or not isinstance(schema, Mapping):
        return schema
    properties = schema.get("properties")
    if not isinstance(properties, Mapping) or argument not in properties:
        return schema
    trimmed = {**schema, "properties": {k: v for k, v in properties.items() if k != argument}}
    required = schema.get("required")
    if isinstance(required, list):
        trimmed["required"] = [name for name in required if name != argument]
    return trimmed


@dataclass(frozen=True)
class Imported:
    """What an import did. `tools`: each listed tool's definition (a new version, or
    unchanged). `unlisted`: the tenant's tools sent to this server whose upstream tool it no
    longer lists, by name — kept as they are: versions are never removed (actions and
    approvals cite them) and no flag retires one tool, so agents are still offered them and
    the upstream refuses their calls; they are named so that a person sees it and decides."""

    tools: list[Defined]
    unlisted: list[str]


def import_tools(server: McpServer, actor: str) -> Imported:
    """Import every tool the server lists, all or nothing (`toolcatalog.import_definitions`
    validates the whole listing first). An unchanged tool keeps its version; a person's
    corrections of an imported tool survive the next import (`reimported`)."""
    from runtime import toolcatalog, tooldefs

    if not server.active:
        raise tooldefs.InvalidTool(
            f"{server.name} is inactive", errors={"server": ["inactive: nothing imported"]}
        )
    listed = fetch_tools(server)
    items = []
    taken: dict[str, list[str]] = {}
    for tool in listed:
        fresh = definition_of(server, tool)
        current = tooldefs.current(server.tenant_id, fresh["name"])
        if current is not None and not _imported_from(current.spec, server):
            taken[fresh["name"]] = [f"already a tool of the tenant's, not from {server.name}"]
        items.append(reimported(fresh, current.spec if current is not None else None))
    if not items:
        raise tooldefs.InvalidTool(
            f"{server.name} lists no tools", errors={"server": ["no tools to import"]}
        )
    names = [item["name"] for item in items]
    clashes = sorted({name for name in names if names.count(name) > 1})
    if clashes:
        raise tooldefs.InvalidTool(
            "upstream tools whose names normalise to the same definition name",
            errors={name: ["two upstream tools have this name"] for name in clashes},
        )
    if taken:  # a person's own tool of that name is not this import's to replace
        raise tooldefs.InvalidTool("upstream tools named like other tools", errors=taken)
    defined = toolcatalog.import_definitions(server.tenant, items, actor)
    return Imported(defined, _unlisted(server, {tool.name for tool in listed}))


def _unlisted(server: McpServer, listed: set[str]) -> list[str]:
    """The tenant's current definitions sent to `server` whose `mcp.tool` is not `listed`
    (imported ones, and any a person defined for it by hand)."""
    from runtime import tooldefs

    return [
        row.name
        for row in tooldefs.current_definitions(server.tenant_id)
        if _imported_from(row.spec, server) and row.spec["mcp"].get("tool") not in listed
    ]
