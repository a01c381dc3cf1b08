"""Tools: adapters for the outside world, declaring how far they can be trusted.

A tool says what kind of effect it has (`read`, `write`, `irreversible`) and how its service
deduplicates (`key`: it honours an idempotency key; `lookup`: it can be asked whether an
effect with a key exists; `none`: neither). The ledger's reconciliation follows from that:
replay with the same key, look up, or hand the question to a human. A tool's call answers
one of: applied (with proof: the external id), refused (permanent, or transient and
certainly not applied), stale (the service says it refused our fence: believed only if the
run's fence moved on, `dispatch.settle_fence_claim`) or unknown.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import httpx
from django.conf import settings
from django.core.exceptions import ValidationError

from fastsql import statements
from runtime import jsonpaths, outbound, urltemplates, wire
from runtime.crypto import Secret, SecretUnreadable
from runtime.errors import InvalidParams
from runtime.paramcheck import ParamsSchema


class Effect:
    READ = "read"
    WRITE = "write"
    IRREVERSIBLE = "irreversible"


class Dedup:
    KEY = "key"
    LOOKUP = "lookup"
    NONE = "none"


class Sender:
    """Who performs a tool's request (API.md, "Tools as data": `executor`). Holdpoint sends
    `http` and `mcp` tools itself, so only Holdpoint can know what came back: an API
    client's word about their outcome is never taken. A `client` tool is performed by an
    external executor, which reports the outcome; the server still reconciles it by the
    tool's dedup contract."""

    HTTP = "http"
    MCP = "mcp"
    CLIENT = "client"


@dataclass(frozen=True)
class CallResult:
    # applied | refused | stale | unknown. `stale` is the service's claim (a 409 naming the
    # fence); the sender checks it against the run's fence before it stops.
    outcome: str
    external_id: str = ""
    result: Any = None
    transient: bool = False  # with "refused": certainly not applied, may succeed later
    detail: str = ""
    # With "refused": Holdpoint refused to send it (a host or address not allowed, a URL or
    # header it cannot build), so the service said nothing — of this request, nor of an
    # earlier one with the same key, which a replay is asked to settle.
    unsent: bool = False

    @property
    def service_failed(self) -> bool:
        """Whether the service is in trouble (no answer, a 5xx, 408/429, no connection):
        what a tool's circuit breaker counts. A refusal of this request (a 4xx: params the
        service will not take, a tenant's wrong credential) is the answer of a service that
        works: counted, one tenant's refusals opened the circuit for every tenant sending
        the same tool (a built-in, or a definition both imported)."""
        return self.outcome == "unknown" or (self.outcome == "refused" and self.transient)


@dataclass(frozen=True)
class LookupResult:
    found: bool | None  # None: the service could not tell
    external_id: str = ""
    result: Any = None
    detail: str = ""


class CircuitOpen(Exception):
    """The tool failed too often recently; calls are refused until the cool-down ends."""


@dataclass
class Breaker:
    """Rate limit (calls per second, per process) and circuit breaker for one tool."""

    rate: float = 0.0
    threshold: int = 5
    cooldown: float = 30.0
    failures: int = 0
    opened_at: float = 0.0
    last_call: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def admit(self) -> None:
        with self.lock:
            now = time.monotonic()
            if self.failures >= self.threshold and now - self.opened_at < self.cooldown:
                raise CircuitOpen(f"circuit open for {self.cooldown - (now - self.opened_at):.0f}s")
            if self.rate > 0:
                wait = self.last_call + 1 / self.rate - now
                if wait > 0:
                    time.sleep(wait)
            self.last_call = time.monotonic()

    def record(self, ok: bool) -> None:
        with self.lock:
            if ok:
                self.failures = 0
                return
            self.failures += 1
            if self.failures >= self.threshold:
                self.opened_at = time.monotonic()


_PLACEHOLDER = re.compile(r"\{(\w+)\}")


@dataclass
class Tool:
    name: str
    version: str = "1"
    effect: str = Effect.WRITE
    dedup: str = Dedup.KEY
    # When set, the dedup mode is read from this setting (it follows the configured service).
    dedup_setting: str = ""
    schema: dict[str, Any] = field(default_factory=lambda: {"type": "object"})
    editable: tuple[str, ...] = ()
    # Static approval requirement; tenant policies (the approvals app) may add more.
    approval: bool | Callable[[dict[str, Any]], bool] = False
    timeout: float = 5.0
    accepts_fence: bool = False
    compensation: str = ""
    # Params whose values the journal keeps as digests only.
    sensitive: tuple[str, ...] = ()
    precheck: Callable[[dict[str, Any]], None] | None = None
    breaker: Breaker = field(default_factory=Breaker)
    # The tenant's ToolCredential (by service name) this tool sends, if any.
    credential: str = ""
    # Who performs the request: Holdpoint (`http`, `mcp`) or an external executor (`client`).
    executor: str = Sender.HTTP
    # How a reviewer's card names one action, verb first: a template over the params and
    # `{target}`, e.g. "Create task: {title}". Plain `{name}` placeholders only (no format
    # mini-language: the template comes from tool data, not code).
    title: str = ""
    description: str = ""
    # A tenant's write tool that no policy names waits for the tenant's reviewers (API.md,
    # "Tools as data": safe by default); built-in tools declare `approval` themselves.
    default_hold: bool = False
    builtin: bool = False
    # The compensating tool's param that receives this action's external id.
    compensation_param: str = "external_id"
    _validator: ParamsSchema | None = field(default=None, repr=False, compare=False)

    def validate(self, params: Any) -> None:
        """Refuse params that do not fit the schema, with field errors, before preparing.
        The validator is built once per tool version (a tool object is one version)."""
        if self._validator is None:
            self._validator = ParamsSchema(self.schema)
        errors = self._validator.errors(params)
        if errors:
            raise InvalidParams(f"params do not fit the {self.name} schema", errors=errors)

    @property
    def mcp_server(self) -> str:
        """The upstream MCP server this tool is sent to ("" for none): whether it is offered
        depends on that server (runtime.toolcatalog.withheld)."""
        return ""

    @property
    def sent_by_holdpoint(self) -> bool:
        return self.executor != Sender.CLIENT

    def dedup_mode(self) -> str:
        return getattr(settings, self.dedup_setting) if self.dedup_setting else self.dedup

    def needs_approval(self, params: dict[str, Any]) -> bool:
        return self.approval(params) if callable(self.approval) else bool(self.approval)

    def title_for(self, params: dict[str, Any], target: str = "") -> str:
        """The verb-first title a reviewer reads for one action ("Create task: Fix login").

        A placeholder the action leaves empty drops the subject and keeps the verb (the
        template up to its first placeholder). Without a template: "Run <name>: <target>".
        """
        template = self.title or f"Run {self.name}: {{target}}"
        values = {**params, "target": target}
        missing = False

        def fill(match: re.Match[str]) -> str:
            nonlocal missing
            value = values.get(match.group(1))
            if value is None or value == "":
                missing = True
                return ""
            return str(value)

        text = _PLACEHOLDER.sub(fill, template)
        if missing:
            text = template.split("{", 1)[0].rstrip(": ")
        return text[:300]

    def call(self, params_text: str, *, key: str, fence: int, run_id: str) -> CallResult:
        raise NotImplementedError

    def lookup(self, key: str, params_text: str = "{}", *, run_id: str) -> LookupResult:
        """Ask the service for the effect of the action with `key`, sent for `run_id` (whose
        tenant's credentials and server rows apply: a key is not parsed for its run — an
        external executor or the MCP gateway chooses keys of its own)."""
        return LookupResult(found=None, detail=f"{self.name} cannot be looked up")


@dataclass(frozen=True)
class OutboundRequest:
    """One request as an http tool would send it (a dry run shows exactly this)."""

    method: str
    url: str
    headers: dict[str, str]
    content: bytes


@dataclass
class HttpTool(Tool):
    """A tool Holdpoint sends itself, from its definition (API.md, "Tools as data"): the
    stored canonical params as the JSON body, the key in the declared header, the fence and
    run, the tenant's credential as a bearer token; the proof id read by JSONPath."""

    method: str = "POST"
    url: urltemplates.UrlTemplate | None = None
    extra_headers: dict[str, str] = field(default_factory=dict)
    key_header: str = "Idempotency-Key"
    lookup_method: str = "GET"
    lookup_url: urltemplates.UrlTemplate | None = None
    found_path: str = ""
    id_path: str = "$.id"

    def build_request(
        self,
        params: Mapping[str, Any],
        *,
        params_text: str | None = None,
        key: str,
        fence: int,
        run_id: str,
        reveal: bool = True,
    ) -> OutboundRequest:
        """The request for these params. `reveal=False` masks the credential (a dry run
        shows where it would go, never what it is)."""
        assert self.url is not None
        text = params_text if params_text is not None else json.dumps(dict(params))
        own = {
            "Content-Type": "application/json",
            self.key_header: key,
            "Holdpoint-Fence": str(fence),
            "Holdpoint-Run": run_id,
            **self.authorization(run_id, reveal=reveal),
        }
        content = b"" if self.method in ("GET", "DELETE") else text.encode("utf-8")
        return OutboundRequest(self.method, self.url.render(params), self._headers(own), content)

    def _headers(self, own: dict[str, str]) -> dict[str, str]:
        """The definition's extra headers (an API version, a team, an Accept) with ours: a
        header of ours replaces a definition's of that name in any case."""
        headers = dict(self.extra_headers)
        if headers:
            taken = {name.lower() for name in own}
            headers = {name: v for name, v in headers.items() if name.lower() not in taken}
        headers.update(own)
        return headers

    def authorization(self, run_id: str, *, reveal: bool = True) -> dict[str, str]:
        """The run's tenant's credential for this tool as a bearer token, if it has one
        (masked unless `reveal`). httpx masks Authorization in its reprs; the value is never
        logged or recorded."""
        secret = credential_for_run(self.credential, run_id)
        if secret is None:
            return {}
        return {"Authorization": "Bearer " + (secret.reveal() if reveal else "********")}

    def call(self, params_text: str, *, key: str, fence: int, run_id: str) -> CallResult:
        """Send exactly the stored canonical bytes; classify what came back."""
        try:
            request = self.build_request(
                json.loads(params_text),
                params_text=params_text,
                key=key,
                fence=fence,
                run_id=run_id,
            )
        except SecretUnreadable as exc:  # nothing was sent; an operator must fix the keys
            return CallResult("refused", transient=True, detail=str(exc))
        except urltemplates.TemplateError as exc:
            return CallResult("refused", detail=f"the URL cannot be built: {exc}", unsent=True)
        try:
            response = wire.send(
                request.method,
                request.url,
                content=request.content or None,
                headers=request.headers,
                timeout=self.timeout,
            )
        except outbound.OutboundRefused as exc:
            if exc.code in ("redirect", "too_large"):
                # The service answered, but not with proof: it may have applied (a 303
                # after a POST usually means it did). The dedup contract settles it.
                return CallResult("unknown", detail=f"{exc.code}: {exc.detail}")
            return CallResult("refused", detail=f"{exc.code}: {exc.detail}", unsent=True)
        except httpx.ConnectError as exc:
            # Nothing reached the service: certainly not applied.
            return CallResult("refused", transient=True, detail=f"connect failed: {exc}")
        except httpx.HTTPError as exc:  # timeout or reset after sending: we cannot know
            return CallResult("unknown", detail=f"{type(exc).__name__}: {exc}")
        token = request.headers.get("Authorization", "").removeprefix("Bearer ")
        return self.classify(response, secret=token)

    def classify(self, response: wire.OutboundResponse, *, secret: str = "") -> CallResult:
        """The outcome the answer proves. `secret`: the credential the request carried,
        masked wherever the answer quotes it back ("invalid token: …"): the answer's text
        becomes the action's error, and a success's body its result and its id, which every
        member of the tenant reads and the journal keeps (`masked_answer`)."""
        return masked_answer(self._classify(response, secret), secret)

    def _classify(self, response: wire.OutboundResponse, secret: str) -> CallResult:
        detail = masked(response.text, secret)[:500]
        status = response.status_code
        if 200 <= status < 300:
            try:
                body = response.json()
            except ValueError as exc:  # not JSON, or nested past what Holdpoint keeps
                return CallResult("unknown", detail=f"success without JSON ({exc}): {detail}")
            try:
                external_id = jsonpaths.compile_path(self.id_path).first(body)
            except jsonpaths.JsonPathError as exc:
                return CallResult("unknown", detail=f"success, its id unreadable: {exc}")
            if not usable_id(external_id):
                return CallResult("unknown", detail=f"success without a usable id: {detail}")
            return CallResult("applied", external_id=str(external_id), result=body)
        if status == 409 and "fence" in detail:
            # Perhaps our fence refused — or a conflict of the service's own whose text
            # names a fence: the sender asks the run (`dispatch.settle_fence_claim`).
            return CallResult("stale", detail=f"HTTP {status}: {detail}")
        if status in (408, 429) or status >= 500:
            return CallResult("unknown", detail=f"HTTP {status}: {detail}")
        return CallResult("refused", detail=f"HTTP {status}: {detail}")

    def lookup(self, key: str, params_text: str = "{}", *, run_id: str) -> LookupResult:
        if self.dedup_mode() == Dedup.NONE or self.lookup_url is None:
            return LookupResult(found=None, detail=f"{self.name} has no lookup by key")
        try:
            params = json.loads(params_text)
            url = self.lookup_url.render({**params, "idempotency_key": key})
            # The definition's extra headers too: a service that needs them to answer the
            # send needs them to answer the lookup (without, every lookup failed and each
            # unknown action went to a person).
            headers = self._headers({"Holdpoint-Run": run_id, **self.authorization(run_id)})
            token = headers.get("Authorization", "").removeprefix("Bearer ")
            response = wire.send(
                self.lookup_method, url, content=None, headers=headers, timeout=self.timeout
            )
        except (outbound.OutboundRefused, urltemplates.TemplateError, SecretUnreadable) as exc:
            return LookupResult(found=None, detail=f"lookup refused: {exc}")
        except (httpx.HTTPError, ValueError) as exc:
            return LookupResult(found=None, detail=f"lookup failed: {exc}")
        if response.status_code == 404:
            return LookupResult(found=False)
        if response.status_code != 200:
            return LookupResult(found=None, detail=f"lookup: HTTP {response.status_code}")
        try:
            body = response.json()
        except ValueError:
            return LookupResult(found=None, detail="lookup answered without JSON")
        verdict = found_in(self.found_path, body)
        if not verdict.found:
            return verdict
        first = body[0] if isinstance(body, list) and body else body
        return masked_answer(replace(verdict, result=first), token)


def found_in(found_path: str, answer: Any, *, bare_object_is_none: bool = False) -> LookupResult:
    """A lookup's verdict from its answer, for every kind of tool. An id at `found_path`:
    found, with that id (the caller adds the answer as its result). Something there that is
    not an id (null, "", an object): no answer. Nothing there: absent only when the answer
    says there is nothing — the path stopped at an empty list or object, or at null (`[]`
    for `$[0].id`, `{"task": null}` for `$.task.id`). A record the path does not reach into
    (`[{"task_id": 7}]` for `$[0].id`: a `found` that names the wrong field) is no answer
    either ("absent" lets the action be sent again, and from a misconfigured path that is a
    duplicate effect on every lookup) — unless the path stopped at a filter of its own,
    which looked at the records and chose none (`$.tasks[?@.key=='k'].id` over other keys'
    tasks: absent). No answer is asked again, then a person decides.

    `bare_object_is_none`: the service has no status to say "none" in (an MCP tool, where an
    HTTP service answers 404): an answer object without even the path's first step (the
    finder's `{"found": false}` for `$.id`) is its "none"."""
    try:
        path = jsonpaths.compile_path(found_path)
        matched = path.values(answer)
        if not matched:
            depth, stopped = path.stopped_at(answer)
    except jsonpaths.JsonPathError as exc:
        return LookupResult(found=None, detail=f"lookup: {exc}")
    if not matched:
        if all(value is None or value == [] or value == {} for value in stopped):
            return LookupResult(found=False)
        if path.filters_at(depth):
            return LookupResult(found=False)  # the definition's filter chose none of them
        if bare_object_is_none and depth == 0 and isinstance(answer, dict):
            return LookupResult(found=False)
        return LookupResult(
            found=None,
            detail=f"lookup: the answer has something, but nothing at {found_path} "
            "(is the definition's `found` right?)",
        )
    if not usable_id(matched[0]):
        return LookupResult(found=None, detail=f"lookup: {found_path} is {matched[0]!r}, not an id")
    return LookupResult(found=True, external_id=str(matched[0]))


def masked(text: str, secret: str) -> str:
    """`text` with `secret` replaced by ******** — as written, and as escaped in a JSON
    string (a service's JSON error may quote it either way). Masked before any truncation,
    which could otherwise leave a prefix of it."""
    if not secret:
        return text
    for form in (secret, json.dumps(secret)[1:-1]):
        text = text.replace(form, "********")
    return text


def masked_value(value: Any, secret: str) -> Any:
    """A service's JSON answer with `secret` masked (`masked`) in every string of it, names
    of members included. Only strings change: a value holding no secret comes back equal,
    so a result, and the JSONPath that read its id, mean what they did."""
    if not secret:
        return value
    if isinstance(value, str):
        return masked(value, secret)
    if isinstance(value, list):
        return [masked_value(item, secret) for item in value]
    if isinstance(value, dict):
        return {masked(str(k), secret): masked_value(v, secret) for k, v in value.items()}
    return value


Answer = TypeVar("Answer", CallResult, LookupResult)


def masked_answer(answer: Answer, secret: str) -> Answer:
    """A call's answer or a lookup's verdict with the credential the request carried masked
    in all that is kept of what the service said: its error, its result (the action's
    `result`: the action page, `GET …/actions/`, the step's `ctx.act` and what the step
    stores from it) and the id read from it (the action's `external_id`, journalled). Masked
    once, here, before anything stores it — for every tool Holdpoint sends (runtime.mcp too)."""
    if not secret:
        return answer
    return replace(
        answer,
        detail=masked(answer.detail, secret),
        external_id=masked(answer.external_id, secret),
        result=masked_value(answer.result, secret),
    )


def usable_id(value: Any) -> bool:
    """Whether a service's value can stand as the external object's id: a number or a
    non-empty string (true/false, null, "" and objects identify nothing)."""
    if isinstance(value, str):
        return value != ""
    return isinstance(value, int | float) and not isinstance(value, bool)


def credential_for_run(service: str, run_id: str) -> Secret | None:
    """The credential of the run's tenant for `service` (None without one). A run never
    changes tenant, so run → tenant is remembered per process; the credential itself is
    read on every call, so a replaced secret is used at once (`ToolCredential.lookup`)."""
    if not service:
        return None
    tenant_id = tenant_of_run(run_id)
    if tenant_id is None:
        return None
    from runtime.models import ToolCredential

    return ToolCredential.lookup(tenant_id, service)


def tenant_of_run(run_id: str) -> int | None:
    """The tenant a run belongs to (None: not a run). A run never changes tenant, so the
    answer is remembered per process."""
    tenant_id = _run_tenants.get(run_id)
    if tenant_id is None:
        from runtime.models import Run

        try:
            tenant_id = (
                Run.objects.filter(run_id=run_id).values_list("tenant_id", flat=True).first()
            )
        except (ValueError, ValidationError):
            tenant_id = None  # not a run id
        if tenant_id is None:
            return None
        remember_run_tenant(run_id, tenant_id)
    return tenant_id


def remember_run_tenant(run_id: str, tenant_id: int) -> None:
    """Tell `tenant_of_run` what a caller that read the run row knows (the executor): the
    run's first call then reads nothing more for its credential."""
    if len(_run_tenants) >= 10_000:
        _run_tenants.clear()
    _run_tenants[run_id] = tenant_id


_run_tenants: dict[str, int] = {}


# --- building tools from definitions ------------------------------------------------------


def changes_something(spec: Mapping[str, Any]) -> bool:
    """A tenant's tool of this definition waits for the tenant's reviewers until a policy
    names it (API.md, "Tools as data": safe by default) — unless it only reads."""
    return spec.get("effect") != Effect.READ


# Tools Holdpoint sends by other means than its HTTP client (`mcp`: runtime.mcp), built by
# the module that knows how; each registers its builder when the app starts (runtime.apps),
# so this module, which they build on, need not import them.
ToolBuilder = Callable[[Mapping[str, Any], dict[str, Any]], Tool]
_senders: dict[str, ToolBuilder] = {}


def register_sender(executor: str, build: ToolBuilder) -> None:
    """`build(spec, fields)` makes the tool of a definition whose `executor` is this one;
    `fields` are the keyword arguments every tool takes (name, version, schema, ...)."""
    _senders[executor] = build


def from_spec(spec: Mapping[str, Any], version: str, *, builtin: bool = False) -> Tool:
    """The tool a validated definition (`runtime.tooldefs.parse`) describes."""
    common: dict[str, Any] = {
        "name": spec["name"],
        "version": version,
        "effect": spec["effect"],
        "dedup": spec["dedup"]["mode"],
        "schema": spec["schema"],
        "editable": tuple(spec.get("editable", ())),
        "sensitive": tuple(spec.get("sensitive", ())),
        "timeout": float(spec.get("timeout_seconds", 5)),
        "compensation": spec.get("compensation", ""),
        "compensation_param": spec.get("compensation_param") or "external_id",
        "credential": spec.get("credential", ""),
        "title": spec.get("title", ""),
        "description": spec.get("description", ""),
        "executor": spec["executor"],
        "builtin": builtin,
        "default_hold": not builtin and changes_something(spec),
        "accepts_fence": spec["executor"] == Sender.HTTP,
    }
    build = _senders.get(spec["executor"])
    if build is not None:
        return build(spec, common)
    if spec["executor"] != Sender.HTTP:
        return Tool(**common)
    request, lookup = spec["request"], spec.get("lookup") or {}
    return HttpTool(
        **common,
        method=request["method"],
        url=urltemplates.UrlTemplate.compile(request["url"]),
        extra_headers=dict(request.get("headers", {})),
        key_header=spec["dedup"].get("header", "Idempotency-Key"),
        lookup_method=lookup.get("method", "GET"),
        lookup_url=urltemplates.UrlTemplate.compile(lookup["url"]) if lookup.get("url") else None,
        found_path=lookup.get("found", ""),
        id_path=spec.get("result", {}).get("external_id", "$.id"),
    )


TRACKER_FILE = Path(__file__).with_name("tooldata") / "tasks.json"
TRACKER_BASE = "http://127.0.0.1:8765"  # where the file's definitions point: make run's sandbox


def tracker_definitions(
    base_url: str = TRACKER_BASE, mode: str = Dedup.KEY
) -> list[dict[str, Any]]:
    """The task tracker's tools as definitions (runtime/tooldata/tasks.json), pointed at
    `base_url` with the tracker's dedup `mode`: what `seed_demo` imports for the demo tenant,
    and what every tenant gets as built-in tools when HOLDPOINT_TASKS_URL is set."""
    text = TRACKER_FILE.read_text(encoding="utf-8").replace(TRACKER_BASE, base_url.rstrip("/"))
    items: list[dict[str, Any]] = json.loads(text)
    for item in items:
        if item.get("lookup") or item["executor"] == Sender.CLIENT:  # closing is always by key
            item["dedup"]["mode"] = mode
    return items


_builtins: dict[tuple[str, str], dict[str, Tool]] = {}


def _builtin_tools() -> dict[str, Tool]:
    """Tools every tenant has: the deployment's task tracker, when HOLDPOINT_TASKS_URL
    names one (a tenant's own definition of the same name takes precedence)."""
    url, mode = settings.HOLDPOINT_TASKS_URL, settings.HOLDPOINT_TASKS_DEDUP
    if not url:
        return {}
    tools = _builtins.get((url, mode))
    if tools is None:
        # The shipped file is checked against `runtime.tooldefs.parse` by the tests.
        specs = tracker_definitions(url, mode)
        tools = {spec["name"]: from_spec(spec, "1", builtin=True) for spec in specs}
        _builtins.clear()
        _builtins[(url, mode)] = tools
    return tools


def builtin_names() -> list[str]:
    return sorted(_builtin_tools())


def tenant_tool_names(tenant_id: int) -> list[str]:
    from runtime.models import ToolDefinition

    names = ToolDefinition.objects.filter(tenant_id=tenant_id).values_list("name", flat=True)
    return sorted(set(names))


# A definition's digest → the tool it defines: a version never changes, so it is compiled
# once per process (schema validator, URL templates, JSONPaths). Keyed by content, not by
# (tenant, name, version): ids are reused (a restored database, a test's rolled-back
# tenant), contents are not.
_defined: dict[str, Tool] = {}


# (tenant, name) → the tool `get_tool` last found current for it, and its version number (0:
# a built-in tool, no definition of the tenant's). Only a guess to be confirmed: a prepare
# written as one statement confirms it with a guard part (`unchanged_part`), any other
# prepare reads the current version again (`dispatch.ActionRunner.prepare`).
_latest: dict[tuple[int, str], tuple[Tool, int]] = {}


def latest_seen(name: str, tenant_id: int) -> tuple[Tool, int] | None:
    """What `get_tool(name, tenant_id)` last returned in this process, with its version
    number (0: built-in) — not read again, so possibly no longer current. A built-in one
    is checked here (settings name the tracker; code registers tools): only a definition of
    the tenant's can have changed it since."""
    seen = _latest.get((tenant_id, name))
    if seen is not None and seen[1] == 0:
        if (_builtin_tools().get(name) or _TOOLS.get(name)) is not seen[0]:
            return None
    return seen


def unchanged_part(
    one: statements.OneStatement, tenant_id: int, name: str, number: int, after: str
) -> statements.Part:
    """A guard part: no definition of the tenant's newer than version `number` (0: none at
    all) — the tool `latest_seen` gave is still the current one. Versions are only ever
    added (ToolDefinition), so "none newer" is "the same"."""
    from runtime.models import ToolDefinition

    where = {"tenant_id": tenant_id, "name": name, "version": statements.Above(number)}
    return one.absent("tool_unchanged", ToolDefinition, where, after=after)


def get_tool(name: str, tenant_id: int | None = None, version: str | None = None) -> Tool:
    """The tool `name` as the tenant may use it: its own definition (the current version,
    or `version`), else a built-in one. Unknown → InvalidParams (422 at the API)."""
    tool, number = _resolve(name, tenant_id, version)
    if tenant_id is not None and version is None:
        if len(_latest) >= 10_000:
            _latest.clear()
        _latest[(tenant_id, name)] = (tool, number)
    return tool


def _resolve(name: str, tenant_id: int | None, version: str | None) -> tuple[Tool, int]:
    if tenant_id is not None:
        from runtime.models import ToolDefinition

        where: dict[str, Any] = {"tenant_id": tenant_id, "name": name}
        if version is not None and version.isdigit():
            where["version"] = int(version)
        # Read on every action (a redefinition must be seen before the send): the fast
        # path's select, not a queryset built each time (a quarter of a millisecond).
        rows = statements.select(
            ToolDefinition, ("version", "digest"), where, order_by=("-version",), limit=1
        )
        if rows:
            number, digest = rows[0]
            tool = _defined.get(digest)
            if tool is None or tool.version != str(number):
                spec = ToolDefinition.objects.get(
                    tenant_id=tenant_id, name=name, version=number
                ).spec
                if len(_defined) >= 10_000:
                    _defined.clear()
                tool = _defined[digest] = from_spec(spec, str(number))
            return tool, number
    tool = _builtin_tools().get(name) or _TOOLS.get(name)
    if tool is None:
        raise InvalidParams(f"unknown tool {name!r}", errors={"tool": ["unknown tool"]})
    return tool, 0


def tool_of(action: Any) -> Tool:
    """The tool an action was prepared with (its recorded version): the contract it was
    sent and must be reconciled under, even after the definition changed."""
    return get_tool(action.tool, action.tenant_id, action.tool_version)


# Tools registered in code (tests, chaos): the same objects for every tenant.
_TOOLS: dict[str, Tool] = {}


def register_tool(tool: Tool) -> Tool:
    _TOOLS[tool.name] = tool
    return tool


def reset_breakers() -> None:
    """Close every circuit (a fresh process starts this way; tests start each case so)."""
    for tool in [*_TOOLS.values(), *_defined.values()]:
        tool.breaker.failures = 0
    for tools in _builtins.values():
        for tool in tools.values():
            tool.breaker.failures = 0
