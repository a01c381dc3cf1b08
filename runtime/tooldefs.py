"""Tools as data: validating a definition and storing its versions (API.md, "Tools as data").

`parse` turns what an admin wrote (JSON from the admin, a file, or `POST tools/`) into the
normalised definition that is stored, or refuses it with every field error at once — before
anything is stored, so a bad definition never becomes a tool. `define` is the one writer of
`ToolDefinition` rows: a changed definition becomes the next version (an unchanged one is
not a new version, so importing the same file twice changes nothing), and the change is
journalled in the tenant's stream.

What is checked, because each would otherwise fail at send time, on a tenant's behalf:
- the schema is a JSON Schema (2020-12) for an object whose `$ref`s point inside it (no
  schema is fetched from elsewhere: that would be a request to any host), and every name
  the definition cites (`editable`, `sensitive`, URL placeholders) is one of its properties;
- URL templates place params only in the path and query (`runtime.urltemplates.UrlTemplate`),
  and their hosts are allowed by `HOLDPOINT_TOOL_HOSTS` (422 `host_not_allowed`);
- JSONPath expressions (`lookup.found`, `result.external_id`) parse (RFC 9535);
- extra headers cannot replace the ones Holdpoint sets (the key — `dedup.header` in any
  case —, the fence, the credential);
- a compensation names a tool that exists;
- an `mcp` tool names an upstream server the tenant registered (runtime.models.McpServer)
  whose URL host is allowed, and declares dedup `none` (MCP has no idempotency contract, so
  a lost answer goes to a person) or `lookup`: then Holdpoint passes the action's key in the
  argument `mcp.key_argument` of every call, and `lookup` names the upstream tool that finds
  an effect by that key (`{"tool", "arguments", "found"}`), as http tools do with a URL.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import jsonschema
from django.db import transaction
from django.db.models import Max

from audit import journal
from audit.canonical import canonical_bytes, digests, sha256_hex
from runtime import jsonpaths, outbound, paramcheck, urltemplates
from runtime.errors import HoldpointError
from runtime.models import McpServer, McpTransport, Tenant, ToolDefinition
from runtime.models.mcp import SERVICE
from runtime.models.tooldefs import timeout_problem
from runtime.tools import builtin_names, tenant_tool_names, tracker_definitions

# `\Z`, not `$`: `$` also matches before a final "\n", which no header name or tool name may
# end in. A credential's service name is the MCP server row's rule (runtime.models.mcp).
NAME = re.compile(r"^[a-z][a-z0-9_-]*(\.[a-z][a-z0-9_-]*)*\Z")
HEADER = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,100}\Z")
EFFECTS = ("read", "write", "irreversible")
EXECUTORS = ("http", "client", "mcp")  # `mcp`: usually imported (runtime.mcp)
MODES = ("key", "lookup", "none")
METHODS = ("POST", "PUT", "PATCH", "DELETE", "GET")
# Headers Holdpoint sets itself on every request: a definition cannot replace them.
RESERVED_HEADERS = {
    "authorization",
    "host",
    "content-length",
    "content-type",
    "transfer-encoding",
    "connection",
    "holdpoint-fence",
    "holdpoint-run",
    "cookie",
}
# The fields of a definition, in the order an admin reads them (API.md's example).
FIELDS = (
    "name",
    "title",
    "description",
    "effect",
    "schema",
    "editable",
    "sensitive",
    "executor",
    "request",
    "credential",
    "dedup",
    "lookup",
    "result",
    "timeout_seconds",
    "compensation",
    "compensation_param",
    "mcp",
)
MAX_TOOL_NAME = 200  # an upstream tool's own name, as MCP spells it


class InvalidTool(HoldpointError):
    code = "invalid_tool"
    status = 422
    title = "Invalid tool definition"


class HostNotAllowed(HoldpointError):
    code = "host_not_allowed"
    status = 422
    title = "The tool's host is not allowed"


class ToolExists(HoldpointError):
    code = "tool_exists"
    status = 409
    title = "A tool with this name exists"


@dataclass
class _Errors:
    fields: dict[str, list[str]]
    hosts: dict[str, list[str]]

    def add(self, where: str, message: str) -> None:
        self.fields.setdefault(where, []).append(message)

    def host(self, where: str, message: str) -> None:
        self.hosts.setdefault(where, []).append(message)


def parse(
    data: Any, *, known_tools: Iterable[str] = (), tenant_id: int | None = None
) -> dict[str, Any]:
    """The normalised definition, or InvalidTool / HostNotAllowed with field errors.

    `known_tools`: names a compensation may cite besides the tenant's (a file imported as a
    whole may define a tool and its compensation together). `tenant_id`: whose registered
    MCP servers an `mcp` tool may name (without it, none)."""
    errors = _Errors({}, {})
    if not isinstance(data, Mapping):
        raise InvalidTool("a tool definition is a JSON object", errors={"tool": ["not an object"]})
    for extra in sorted(set(data) - set(FIELDS)):
        errors.add(extra, "unknown field")
    spec: dict[str, Any] = {}
    name = data.get("name")
    if not isinstance(name, str) or not NAME.match(name) or len(name) > 100:
        errors.add("name", "lower-case words separated by dots, e.g. tickets.create")
    spec["name"] = name
    spec["description"] = _text(data, "description", 2000, errors)
    spec["title"] = _text(data, "title", 300, errors)
    spec["effect"] = _choice(data, "effect", EFFECTS, None, errors)
    schema = data.get("schema", {"type": "object"})
    properties = _schema(schema, errors)
    spec["schema"] = schema
    spec["editable"] = _names(data, "editable", properties, errors)
    spec["sensitive"] = _names(data, "sensitive", properties, errors)
    executor = spec["executor"] = _choice(data, "executor", EXECUTORS, "http", errors)
    credential = data.get("credential", "")
    if not isinstance(credential, str) or (credential and not SERVICE.match(credential)):
        errors.add("credential", "a credential's service name, e.g. tasks")
    spec["credential"] = credential
    dedup = data.get("dedup", {})
    if not isinstance(dedup, Mapping):
        errors.add("dedup", "an object: {mode, header}")
        dedup = {}
    for extra in sorted(set(dedup) - {"mode", "header"}):
        errors.add(f"dedup.{extra}", "unknown field")
    mode = _choice(dedup, "mode", MODES, None, errors, where="dedup.mode")
    header = dedup.get("header", "Idempotency-Key")
    if not isinstance(header, str) or not HEADER.match(header):
        errors.add("dedup.header", "an HTTP header name")
    elif header.lower() in RESERVED_HEADERS:
        errors.add("dedup.header", f"{header} is set by Holdpoint")
    spec["dedup"] = {"mode": mode, "header": header}
    params = set(properties)
    if executor == "http":
        spec["request"] = _request(data.get("request"), params, header, errors)
    elif "request" in data:
        errors.add("request", f"an {executor} tool has no http request")
    lookup = data.get("lookup")
    if executor == "mcp":
        spec["mcp"] = _mcp(data.get("mcp"), tenant_id, errors)
        if mode == "key":
            errors.add("dedup.mode", "none or lookup: MCP has no idempotency contract")
        if mode == "lookup" and not spec["mcp"].get("key_argument"):
            errors.add("mcp.key_argument", "dedup mode lookup needs the argument the key goes in")
        if spec["mcp"].get("key_argument") in params:
            errors.add("mcp.key_argument", "Holdpoint fills it: not a param of the schema")
        if mode == "lookup" or lookup is not None:
            spec["lookup"] = _mcp_lookup(lookup, params, errors)
    elif "mcp" in data:
        errors.add("mcp", "only an mcp tool names an upstream MCP server")
    if lookup is not None and executor != "mcp":
        spec["lookup"] = _lookup(lookup, params, errors, needs_url=executor == "http")
    elif mode == "lookup" and executor == "http":
        errors.add("lookup", "dedup mode lookup needs a lookup request")
    result = data.get("result", {})
    if not isinstance(result, Mapping) or set(result) - {"external_id"}:
        errors.add("result", "an object: {external_id: JSONPath}")
        result = {}
    spec["result"] = {"external_id": _path(result.get("external_id", "$.id"), "result", errors)}
    timeout = data.get("timeout_seconds", 5)
    if trouble := timeout_problem(timeout):
        errors.add("timeout_seconds", trouble)
    spec["timeout_seconds"] = timeout
    compensation = data.get("compensation", "")
    if not isinstance(compensation, str) or (compensation and not NAME.match(compensation)):
        errors.add("compensation", "the name of the tool that undoes this one, or empty")
    elif compensation and compensation == name:
        errors.add("compensation", "a tool cannot compensate itself")
    elif compensation and compensation not in set(known_tools):
        errors.add("compensation", f"no tool {compensation!r} is defined")
    spec["compensation"] = compensation
    spec["compensation_param"] = _text(data, "compensation_param", 100, errors) or "external_id"
    if errors.fields:
        raise InvalidTool(
            f"the definition has {sum(map(len, errors.fields.values()))} error(s)",
            errors={**errors.fields, **errors.hosts},
        )
    if errors.hosts:
        raise HostNotAllowed(
            "the tool would send requests to a host not allowed", errors=errors.hosts
        )
    return spec


def _text(data: Mapping[str, Any], key: str, limit: int, errors: _Errors) -> str:
    value = data.get(key, "")
    if not isinstance(value, str):
        errors.add(key, "a string")
        return ""
    if len(value) > limit:
        errors.add(key, f"at most {limit} characters")
    return value


def _choice(
    data: Mapping[str, Any],
    key: str,
    choices: tuple[str, ...],
    default: str | None,
    errors: _Errors,
    *,
    where: str = "",
) -> str:
    value = data.get(key, default)
    if value not in choices:
        errors.add(where or key, f"one of: {', '.join(choices)}")
        return ""
    return str(value)


def _schema(schema: Any, errors: _Errors) -> dict[str, Any]:
    """The schema's properties, after checking it is a 2020-12 schema of an object."""
    if not isinstance(schema, Mapping):
        errors.add("schema", "a JSON Schema object")
        return {}
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        errors.add("schema", f"not a valid JSON Schema: {exc.message}")
        return {}
    ref = paramcheck.unresolved_ref(schema)
    if ref:
        errors.add("schema", f"$ref {ref!r} does not point inside the schema (none is fetched)")
    elif trouble := paramcheck.ref_trouble(schema):
        errors.add("schema", trouble)
    elif paramcheck.has_regex(schema):
        try:
            paramcheck.regex_validator(schema)
        except ValueError as exc:
            errors.add("schema", f"a regular expression Holdpoint cannot run: {exc}")
    if schema.get("type") != "object":
        errors.add("schema", 'params are an object: "type": "object"')
    properties = schema.get("properties", {})
    return dict(properties) if isinstance(properties, Mapping) else {}


def _names(
    data: Mapping[str, Any], key: str, properties: Mapping[str, Any], errors: _Errors
) -> list[str]:
    names = data.get(key, [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        errors.add(key, "a list of param names")
        return []
    for unknown in sorted(set(names) - set(properties)):
        errors.add(key, f"{unknown!r} is not a property of the schema")
    return sorted(set(names))


def _template(
    url: Any, where: str, placeholders: set[str], errors: _Errors
) -> urltemplates.UrlTemplate | None:
    if not isinstance(url, str) or not url:
        errors.add(where, "a URL")
        return None
    try:
        template = urltemplates.UrlTemplate.compile(url)
    except urltemplates.TemplateError as exc:
        errors.add(where, str(exc))
        return None
    for unknown in sorted(set(template.placeholders) - placeholders):
        errors.add(where, f"{{{unknown}}} is not a param of the schema")
    try:
        outbound.check_url(template.render({name: "x" for name in template.placeholders}))
    except outbound.OutboundRefused as exc:
        if exc.code == "host_not_allowed":
            errors.host(where, exc.detail)
        else:
            errors.add(where, exc.detail)
    return template


def _request(request: Any, params: set[str], key_header: Any, errors: _Errors) -> dict[str, Any]:
    if not isinstance(request, Mapping):
        errors.add("request", "an http tool needs a request: {method, url, headers}")
        return {}
    for extra in sorted(set(request) - {"method", "url", "headers"}):
        errors.add(f"request.{extra}", "unknown field")
    method = _choice(request, "method", METHODS, "POST", errors, where="request.method")
    url = request.get("url")
    _template(url, "request.url", params, errors)
    headers = request.get("headers", {})
    if not isinstance(headers, Mapping):
        errors.add("request.headers", "an object of header names to values")
        headers = {}
    for key, value in headers.items():
        if not HEADER.match(str(key)):
            errors.add("request.headers", f"{key!r} is not a header name")
        elif str(key).lower() in RESERVED_HEADERS:
            errors.add("request.headers", f"{key} is set by Holdpoint")
        elif isinstance(key_header, str) and str(key).lower() == key_header.lower():
            # Sent beside the action's key, as a second header: a service reading the first
            # would take this constant for every action's key.
            errors.add("request.headers", f"{key} carries the action's key (dedup.header)")
        if not isinstance(value, str) or not _sendable(str(key), value):
            errors.add("request.headers", f"{key}: a single-line string HTTP can carry")
    return {"method": method, "url": url, "headers": dict(headers)}


def _sendable(name: str, value: str) -> bool:
    """Whether a header can be sent as written (`outbound.check_headers`): no line break,
    no other control character, nothing past Latin-1 — else every action would be refused
    at send time."""
    try:
        outbound.check_headers({name: value})
    except outbound.OutboundRefused:
        return False
    return True


def _lookup(lookup: Any, params: set[str], errors: _Errors, *, needs_url: bool) -> dict[str, Any]:
    if not isinstance(lookup, Mapping):
        errors.add("lookup", "an object: {method, url, found}")
        return {}
    for extra in sorted(set(lookup) - {"method", "url", "found"}):
        errors.add(f"lookup.{extra}", "unknown field")
    spec: dict[str, Any] = {"found": _path(lookup.get("found", "$[0].id"), "lookup.found", errors)}
    if needs_url or "url" in lookup:
        spec["method"] = _choice(
            lookup, "method", ("GET", "POST"), "GET", errors, where="lookup.method"
        )
        spec["url"] = lookup.get("url")
        template = _template(spec["url"], "lookup.url", params | {"idempotency_key"}, errors)
        if template is not None and "idempotency_key" not in template.placeholders:
            # Without the key every action asks the same question, and whatever it finds
            # would confirm each of them.
            errors.add("lookup.url", "the lookup asks by the action's key: {idempotency_key}")
    return spec


def _mcp_lookup(lookup: Any, params: set[str], errors: _Errors) -> dict[str, Any]:
    """`{"tool": <upstream tool>, "arguments": {...}, "found": JSONPath}`: the call that finds
    an effect by key. An argument whose value is exactly `"{name}"` takes the action's param
    `name` (or its key, `{idempotency_key}`) with its JSON type; other values are literal."""
    if not isinstance(lookup, Mapping):
        errors.add("lookup", "an object: {tool, arguments, found}")
        return {}
    for extra in sorted(set(lookup) - {"tool", "arguments", "found"}):
        errors.add(f"lookup.{extra}", "unknown field")
    tool, arguments = lookup.get("tool"), lookup.get("arguments", {})
    if not isinstance(tool, str) or not tool or len(tool) > MAX_TOOL_NAME:
        errors.add("lookup.tool", f"the upstream lookup tool's name (1 to {MAX_TOOL_NAME} chars)")
    if not isinstance(arguments, Mapping):
        errors.add("lookup.arguments", "an object of the lookup tool's arguments")
        arguments = {}
    for name, value in arguments.items():
        placeholder = _placeholder(value)
        if placeholder is not None and placeholder not in params | {"idempotency_key"}:
            errors.add(f"lookup.arguments.{name}", f"{{{placeholder}}} is not a param")
    if "{idempotency_key}" not in arguments.values():
        errors.add("lookup.arguments", 'one argument must be "{idempotency_key}"')
    found = _path(lookup.get("found", "$.id"), "lookup.found", errors)
    return {"tool": tool, "arguments": dict(arguments), "found": found}


def _placeholder(value: Any) -> str | None:
    """`name` for a value that is exactly `"{name}"`."""
    if isinstance(value, str) and value.startswith("{") and value.endswith("}"):
        return value[1:-1]
    return None


def _mcp(value: Any, tenant_id: int | None, errors: _Errors) -> dict[str, Any]:
    """`{"server": <the tenant's McpServer name>, "tool": <the upstream's tool name>}`, and
    `key_argument`: the argument Holdpoint fills with the action's key (for `lookup`)."""
    if not isinstance(value, Mapping):
        errors.add("mcp", "an object: {server, tool}")
        return {}
    for extra in sorted(set(value) - {"server", "tool", "key_argument", "imported"}):
        errors.add(f"mcp.{extra}", "unknown field")
    server_name, tool = value.get("server"), value.get("tool")
    if not isinstance(tool, str) or not tool or len(tool) > MAX_TOOL_NAME:
        errors.add("mcp.tool", f"the upstream tool's name (1 to {MAX_TOOL_NAME} characters)")
    key_argument = value.get("key_argument", "")
    if not isinstance(key_argument, str) or len(key_argument) > MAX_TOOL_NAME:
        errors.add("mcp.key_argument", "the name of the argument the action's key goes in")
        key_argument = ""
    named: dict[str, Any] = {"server": server_name, "tool": tool}
    if key_argument:
        named["key_argument"] = key_argument
    imported = value.get("imported")
    if imported is not None:
        # What the upstream said at the last import (runtime.mcpimport.reimported): kept as given.
        if not isinstance(imported, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) and len(v) <= 64 for k, v in imported.items()
        ):
            errors.add("mcp.imported", "the import's record: field names to short digests")
        else:
            named["imported"] = dict(imported)
    if not isinstance(server_name, str) or not server_name:
        errors.add("mcp.server", "the name of one of the tenant's MCP servers")
        return named
    server = (
        McpServer.objects.filter(tenant_id=tenant_id, name=server_name).first()
        if tenant_id is not None
        else None
    )
    if server is None:
        errors.add("mcp.server", f"no MCP server {server_name!r} is registered for the tenant")
    elif server.transport == McpTransport.STREAMABLE_HTTP:
        try:
            outbound.check_url(server.url)
        except outbound.OutboundRefused as exc:
            if exc.code == "host_not_allowed":
                errors.host("mcp.server", exc.detail)
            else:
                errors.add("mcp.server", exc.detail)
    return named


def _path(expr: Any, where: str, errors: _Errors) -> str:
    if not isinstance(expr, str) or not expr:
        errors.add(where, "a JSONPath expression (RFC 9535), e.g. $.id")
        return ""
    try:
        jsonpaths.compile_path(expr)
    except jsonpaths.JsonPathError as exc:
        errors.add(where, str(exc))
    return expr


def builtin_specs() -> dict[str, dict[str, Any]]:
    """Name → normalised definition of each built-in tool (the deployment's tracker, when
    HOLDPOINT_TASKS_URL names one), for listings beside the tenant's own."""
    from django.conf import settings

    if not settings.HOLDPOINT_TASKS_URL:
        return {}
    specs = tracker_definitions(settings.HOLDPOINT_TASKS_URL, settings.HOLDPOINT_TASKS_DEDUP)
    names = [spec["name"] for spec in specs]
    return {spec["name"]: parse(spec, known_tools=names) for spec in specs}


def digest(spec: Mapping[str, Any]) -> str:
    return sha256_hex(canonical_bytes(dict(spec)))


def current(tenant_id: int, name: str) -> ToolDefinition | None:
    return (
        ToolDefinition.objects.filter(tenant_id=tenant_id, name=name).order_by("-version").first()
    )


def current_definitions(tenant_id: int) -> list[ToolDefinition]:
    """The highest version of each of the tenant's tools, by name."""
    latest = {
        row["name"]: row["top"]
        for row in ToolDefinition.objects.filter(tenant_id=tenant_id)
        .values("name")
        .annotate(top=Max("version"))
    }
    rows = ToolDefinition.objects.filter(tenant_id=tenant_id, name__in=list(latest))
    return sorted(
        (row for row in rows if row.version == latest[row.name]), key=lambda row: row.name
    )


@dataclass(frozen=True)
class Defined:
    definition: ToolDefinition
    created: bool  # False: the same definition was already the current version


def define(
    tenant: Tenant,
    data: Any,
    actor: str,
    *,
    create_only: bool = False,
    known_tools: Iterable[str] = (),
    settle: Callable[[Any, bool], None] | None = None,
) -> Defined:
    """Store a definition as the tool's next version (the one writer of definitions).

    `create_only` (`POST tools/`): a name the tenant already defined is 409 `tool_exists`;
    otherwise (admin, import) a changed definition is a new version, an unchanged one is
    left as it is. Either way the definition is validated first and nothing is stored if it
    is refused. `settle` records the definition on the request's Idempotency-Key claim in
    the same transaction."""
    known = set(known_tools) | set(tenant_tool_names(tenant.pk)) | set(builtin_names())
    spec = parse(data, known_tools=known, tenant_id=tenant.pk)
    name, (fingerprint, *earlier) = spec["name"], digests(dict(spec))
    with transaction.atomic():
        # One writer per tenant at a time: the tenant row is the lock (versions are
        # numbered in order, and a concurrent second "create" sees the first).
        Tenant.objects.select_for_update().filter(pk=tenant.pk).first()
        latest = current(tenant.pk, name)
        if latest is not None and create_only:
            raise ToolExists(f"{name} exists (version {latest.version}); change it to version it")
        # A definition stored before Holdpoint wrote RFC 8785 may hold its digest in the
        # earlier form (audit.canonical.digests): the same spec again is no new version,
        # which would re-stamp its held actions and supersede their approvals.
        if latest is not None and latest.digest in (fingerprint, *earlier):
            return Defined(latest, created=False)
        row = ToolDefinition.objects.create(
            tenant=tenant,
            name=name,
            version=(latest.version + 1) if latest else _first_version(name),
            spec=spec,
            digest=fingerprint,
            created_by=actor[:200],
        )
        journal.append(
            journal.tenant_stream(tenant.pk),
            "tool_defined",
            tenant_id=tenant.pk,
            actor=actor,
            payload={"tool": name, "version": row.version, "digest": fingerprint},
            object_ref=f"tool:{name}",
        )
        if settle is not None:
            settle(row.pk, True)
    return Defined(row, created=True)


def _first_version(name: str) -> int:
    """A built-in tool is version 1 of its name (runtime.tools: "1"), so a tenant's own
    definition of that name starts at 2: an action prepared with the built-in and approved
    for it is then sent, and reconciled, under the version it was given for (a changed
    version re-stamps it and supersedes the approval), not under the tenant's version 1."""
    return 2 if name in builtin_names() else 1


def define_many(tenant: Tenant, items: list[Any], actor: str) -> list[Defined]:
    """A file's definitions, all or nothing: each may cite the others as compensation."""
    names = [item.get("name") for item in items if isinstance(item, Mapping)]
    known = [n for n in names if isinstance(n, str)]
    with transaction.atomic():
        return [define(tenant, item, actor, known_tools=known) for item in items]
