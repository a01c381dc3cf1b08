"""Tools: adapters for the outside world, declaring how far they can be trusted.

A tool says what kind of effect it has (`read`, `write`, `irreversible`) and how its service
deduplicates (`key`: it honours an idempotency key; `lookup`: it can be asked whether an
effect with a key exists; `none`: neither). The ledger's reconciliation follows from that:
replay with the same key, look up, or hand the question to a human. A tool's call answers
one of: applied (with proof: the external id), refused (permanent, or transient and
certainly not applied), stale (the service refused our fence) or unknown.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import jsonschema
from django.conf import settings
from django.core.exceptions import ValidationError

from runtime.crypto import Secret, SecretUnreadable
from runtime.errors import InvalidParams
from runtime.outbound import http_client


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
    outcome: str  # applied | refused | stale | unknown
    external_id: str = ""
    result: Any = None
    transient: bool = False  # with "refused": certainly not applied, may succeed later
    detail: str = ""


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
    # mini-language: a template may one day come from tool data, not code).
    title: str = ""

    def validate(self, params: Any) -> None:
        """Refuse params that do not fit the schema, with field errors, before preparing."""
        validator = jsonschema.Draft202012Validator(self.schema)
        errors: dict[str, list[str]] = {}
        for error in validator.iter_errors(params):
            where = ".".join(str(p) for p in error.absolute_path) or "params"
            errors.setdefault(where, []).append(error.message)
        if errors:
            raise InvalidParams(f"params do not fit the {self.name} schema", errors=errors)

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

    def lookup(self, key: str) -> LookupResult:
        return LookupResult(found=None, detail=f"{self.name} cannot be looked up")


class TaskTool(Tool):
    """The task tracker's HTTP API (the sandbox task service, or a team's real one)."""

    path: str = "/tasks"

    @property
    def base_url(self) -> str:
        return settings.HOLDPOINT_TASKS_URL.rstrip("/")

    def headers(self, key: str, fence: int, run_id: str) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Idempotency-Key": key}
        if self.accepts_fence:
            headers.update({"Holdpoint-Fence": str(fence), "Holdpoint-Run": run_id})
        return headers | self.auth_headers(run_id)

    def auth_headers(self, run_id: str) -> dict[str, str]:
        """The run's tenant's credential for this service as a bearer token, if it has one.
        httpx masks Authorization in its reprs; the value is never logged or recorded."""
        secret = credential_for_run(self.credential, run_id)
        return {"Authorization": f"Bearer {secret.reveal()}"} if secret is not None else {}

    def call(self, params_text: str, *, key: str, fence: int, run_id: str) -> CallResult:
        return self.post(self.path, params_text, key=key, fence=fence, run_id=run_id)

    def post(self, path: str, params_text: str, *, key: str, fence: int, run_id: str) -> CallResult:
        """Send exactly the stored canonical bytes; classify what came back."""
        try:
            response = http_client().post(
                self.base_url + path,
                content=params_text.encode("utf-8"),
                headers=self.headers(key, fence, run_id),
                timeout=httpx.Timeout(self.timeout),
            )
        except httpx.ConnectError as exc:
            # Nothing reached the service: certainly not applied.
            return CallResult("refused", transient=True, detail=f"connect failed: {exc}")
        except SecretUnreadable as exc:  # nothing was sent; an operator must fix the keys
            return CallResult("refused", transient=True, detail=str(exc))
        except httpx.HTTPError as exc:  # timeout or reset after sending: we cannot know
            return CallResult("unknown", detail=f"{type(exc).__name__}: {exc}")
        return classify(response)

    def lookup(self, key: str) -> LookupResult:
        if self.dedup_mode() == Dedup.NONE:
            return LookupResult(found=None, detail="the service has no lookup by key")
        try:
            response = http_client().get(
                self.base_url + "/tasks",
                params={"key": key},
                headers=self.auth_headers(key.split(":", 1)[0]),  # ledger keys start with the run
                timeout=httpx.Timeout(self.timeout),
            )
            response.raise_for_status()
            found = response.json()
        except (httpx.HTTPError, ValueError, SecretUnreadable) as exc:
            return LookupResult(found=None, detail=f"lookup failed: {exc}")
        if not found:
            return LookupResult(found=False)
        return LookupResult(found=True, external_id=str(found[0]["id"]), result=found[0])


def credential_for_run(service: str, run_id: str) -> Secret | None:
    """The credential of the run's tenant for `service` (None without one). A run never
    changes tenant, so run → tenant is remembered per process; the credential itself is
    read (and decrypted) on every call, so a replaced secret is used at once."""
    if not service:
        return None
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
        if len(_run_tenants) >= 10_000:
            _run_tenants.clear()
        _run_tenants[run_id] = tenant_id
    from runtime.models import ToolCredential

    return ToolCredential.lookup(tenant_id, service)


_run_tenants: dict[str, int] = {}


def credential_names() -> list[str]:
    """Service names of the credentials registered tools send (the admin's choices)."""
    return sorted({tool.credential for tool in _TOOLS.values() if tool.credential})


def classify(response: httpx.Response) -> CallResult:
    detail = response.text[:500]
    if response.status_code in (200, 201):
        try:
            body = response.json()
            return CallResult("applied", external_id=str(body["id"]), result=body)
        except (ValueError, KeyError, TypeError):
            return CallResult("unknown", detail=f"success without a usable id: {detail}")
    if response.status_code == 409 and "fence" in detail:
        return CallResult("stale", detail=detail)
    if response.status_code in (408, 429) or response.status_code >= 500:
        return CallResult("unknown", detail=f"HTTP {response.status_code}: {detail}")
    return CallResult("refused", detail=f"HTTP {response.status_code}: {detail}")


class TaskCloseTool(TaskTool):
    """Closing a task: the compensation of tasks.create."""

    def call(self, params_text: str, *, key: str, fence: int, run_id: str) -> CallResult:
        task_id = json.loads(params_text)["task_id"]
        return self.post(
            f"/tasks/{task_id}/close", params_text, key=key, fence=fence, run_id=run_id
        )


_TOOLS: dict[str, Tool] = {}


def register_tool(tool: Tool) -> Tool:
    _TOOLS[tool.name] = tool
    return tool


def get_tool(name: str) -> Tool:
    try:
        return _TOOLS[name]
    except KeyError:
        raise InvalidParams(f"unknown tool {name!r}", errors={"tool": ["unknown tool"]}) from None


def reset_breakers() -> None:
    """Close every circuit (a fresh process starts this way; tests start each case so)."""
    for tool in _TOOLS.values():
        tool.breaker.failures = 0


def tool_names() -> list[str]:
    return sorted(_TOOLS)


TASK_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 1, "maxLength": 200},
        "body": {"type": "string", "maxLength": 20000},
        "assignee": {"type": "string", "maxLength": 100},
    },
    "required": ["title"],
    "additionalProperties": False,
}


register_tool(
    TaskTool(
        name="tasks.create",
        dedup_setting="HOLDPOINT_TASKS_DEDUP",
        effect=Effect.WRITE,
        schema=TASK_SCHEMA,
        editable=("title", "body", "assignee"),
        timeout=3.0,
        accepts_fence=True,
        compensation="tasks.close",
        credential="tasks",
        title="Create task: {title}",
    )
)
register_tool(
    TaskCloseTool(
        name="tasks.close",
        effect=Effect.WRITE,
        dedup=Dedup.KEY,
        schema={
            "type": "object",
            "properties": {
                "task_id": {"type": "string", "minLength": 1},
                "reason": {"type": "string", "maxLength": 2000},
            },
            "required": ["task_id"],
            "additionalProperties": False,
        },
        timeout=3.0,
        accepts_fence=True,
        credential="tasks",
        title="Close task: {task_id}",
    )
)
# The same tracker, performed by an external executor itself (`executor: client`): the agent
# calls the service and reports what came back; the server reconciles by the same dedup
# contract as tasks.create's (HOLDPOINT_TASKS_DEDUP). Workers never send it.
register_tool(
    Tool(
        name="agent.tasks.create",
        executor=Sender.CLIENT,
        dedup_setting="HOLDPOINT_TASKS_DEDUP",
        effect=Effect.WRITE,
        schema=TASK_SCHEMA,
        editable=("title", "body", "assignee"),
        timeout=3.0,
        title="Create task: {title}",
    )
)
