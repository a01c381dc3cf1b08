"""What the isolation tests share: the URL map, database snapshots, answer signatures and
the coverage summary (TEST-MATRIX E1, E2, E4; DESIGN.md invariant 9).

The URL map is read from Django's resolver, never typed in: a route added tomorrow shows up
here, and the tests fail until they know how to probe it (no silent skips).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import connection
from django.urls import URLPattern, URLResolver, get_resolver

# Every method a client can send. Views that do not implement one answer 405 (with an Allow
# header that proves it); the matrix calls them all anyway, so "not implemented" is checked
# rather than assumed.
METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
SAFE = frozenset({"GET", "HEAD", "OPTIONS"})

# The session table is compared like any other, except the callers' own rows (passed to
# `db_state` as `own_sessions`): SessionTimeoutMiddleware renews a person's session expiry
# on each request they make (the inactivity timeout) — bookkeeping of that caller's own
# session. Another session created, changed or deleted by a probe is a change (issue 16:
# the whole table used to be skipped).
SESSION_TABLE = "django_session"
# Columns likewise: when the caller's own API token was last used (written at most once a
# minute, runtime.models.tokens.TOUCH_EVERY).
BOOKKEEPING_COLUMNS = {"runtime_agenttoken": {"last_used_at"}}

_CONVERTER = re.compile(r"<(?:(?P<type>\w+):)?(?P<name>\w+)>")


@dataclass(frozen=True)
class Route:
    """One URL pattern as the resolver holds it."""

    pattern: str  # e.g. "api/v1/runs/<uuid:run_id>/", as Django prints it
    name: str | None
    kwargs: tuple[str, ...]
    callback: Any = field(compare=False, repr=False)
    is_regex: bool = False

    @property
    def key(self) -> str:
        """What the tests' tables are keyed by: the route's name, else its pattern."""
        return self.name or self.pattern

    @property
    def area(self) -> str:
        if self.pattern.startswith("admin/"):
            return "admin"
        if self.pattern.startswith("api/"):
            return "api"
        return "page"

    def url(self, values: dict[str, Any] | None = None) -> str:
        values = values or {}
        return "/" + _CONVERTER.sub(lambda m: str(values[m.group("name")]), self.pattern)


def all_routes() -> list[Route]:
    """Every URL pattern of config.urls, recursively (api/v1, admin, pages, probes)."""
    found: list[Route] = []

    def walk(patterns: Iterable[Any], prefix: str, regex: bool) -> None:
        for entry in patterns:
            text = str(entry.pattern)
            is_regex = regex or text.startswith("^") or text.endswith("$")
            if isinstance(entry, URLResolver):
                walk(entry.url_patterns, prefix + text, is_regex)
            elif isinstance(entry, URLPattern):
                kwargs = tuple(_CONVERTER_NAMES(entry))
                found.append(Route(prefix + text, entry.name, kwargs, entry.callback, is_regex))

    walk(get_resolver().url_patterns, "", False)
    return found


def _CONVERTER_NAMES(entry: URLPattern) -> list[str]:  # noqa: N802 (reads like a table)
    converters = getattr(entry.pattern, "converters", None)
    if converters:
        return list(converters)
    return list(re.compile(entry.pattern.regex.pattern).groupindex)


def openapi_operations() -> set[tuple[str, str]]:
    """(path, METHOD) of every operation in the OpenAPI document the API serves."""
    from drf_spectacular.generators import SchemaGenerator

    schema = SchemaGenerator().get_schema(request=None, public=True)
    verbs = {m.lower() for m in METHODS}
    return {
        (path, method.upper())
        for path, item in schema["paths"].items()
        for method in item
        if method in verbs
    }


def openapi_path(route: Route) -> str:
    """The OpenAPI spelling of a resolver pattern: `/api/v1/runs/{run_id}/`."""
    return "/" + _CONVERTER.sub(lambda m: "{" + m.group("name") + "}", route.pattern)


# --- database snapshots ---------------------------------------------------------------------


def sessions_of(*clients: Any) -> set[str]:
    """The session keys of test clients (those logged in), for `db_state(own_sessions=…)`."""
    cookie = settings.SESSION_COOKIE_NAME
    return {c.cookies[cookie].value for c in clients if cookie in c.cookies}


def db_state(own_sessions: Iterable[str] = ()) -> dict[str, tuple[int, str]]:
    """Row count and a digest of every row of every table (bookkeeping columns aside, and
    the callers' own session rows: see SESSION_TABLE).

    Raw SQL over the introspected table list, so tables of apps added later (and
    many-to-many tables) are included without anyone remembering to list them.
    """
    own = set(own_sessions)
    state: dict[str, tuple[int, str]] = {}
    with connection.cursor() as cursor:
        for table in sorted(connection.introspection.table_names(cursor)):
            cursor.execute(f"SELECT * FROM {connection.ops.quote_name(table)}")  # noqa: S608
            skip = BOOKKEEPING_COLUMNS.get(table, set())
            keep = [i for i, col in enumerate(cursor.description) if col[0] not in skip]
            found = cursor.fetchall()
            if table == SESSION_TABLE:
                key = [col[0] for col in cursor.description].index("session_key")
                found = [row for row in found if row[key] not in own]
            rows = sorted(repr(tuple(row[i] for i in keep)) for row in found)
            digest = hashlib.sha256("\n".join(rows).encode()).hexdigest()
            state[table] = (len(rows), digest)
    return state


def changed_tables(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    return sorted(t for t in set(before) | set(after) if before.get(t) != after.get(t))


def tenant_state(tenant_id: int) -> dict[str, str]:
    """A digest of one tenant's rows in every model that carries a tenant (the rows another
    tenant's request must never touch, even where it may legitimately write its own).

    Bookkeeping columns aside, as in `db_state`: a probe straddling the minute in which the
    caller's own token records its use would otherwise read as a change to its tenant.
    """
    from django.apps import apps

    state: dict[str, str] = {}
    for model in apps.get_models():
        names = [f.attname for f in model._meta.concrete_fields]
        if "tenant_id" not in names:
            continue
        skip = BOOKKEEPING_COLUMNS.get(model._meta.db_table, set())
        kept = [name for name in names if name not in skip]
        rows = model._default_manager.filter(tenant_id=tenant_id).order_by("pk").values_list(*kept)
        state[model._meta.label] = hashlib.sha256(repr(list(rows)).encode()).hexdigest()
    return state


# --- answers ----------------------------------------------------------------------------------

# Headers that differ between two identical requests for reasons unrelated to the object.
VOLATILE_HEADERS = frozenset({"set-cookie", "date", "expires"})  # expires: never_cache sets now
_CSRF_VALUE = re.compile(rb'(name="csrfmiddlewaretoken" value=")[^"]*(")')
_CSRF_META = re.compile(rb'(csrf-token" content=")[^"]*(")')
_PLACEHOLDER = re.compile(r'placeholder="[^"]*"')
_CSRF_JSON = re.compile(rb'(?i)(X-CSRFToken"\]? ?[:=] ?")[A-Za-z0-9]+(")')


def body_of(response: Any) -> bytes:
    """The answer's bytes; a streamed answer is read once and kept for later reads."""
    if getattr(response, "streaming", False):
        if not hasattr(response, "_matrix_body"):
            response._matrix_body = b"".join(response.streaming_content)
        return bytes(response._matrix_body)
    return bytes(response.content)


def without_csrf(body: bytes) -> bytes:
    """A masked CSRF token is fresh random bytes on every render (BREACH mitigation): equal
    pages differ there and only there."""
    for pattern in (_CSRF_VALUE, _CSRF_META, _CSRF_JSON):
        body = pattern.sub(rb"\1<csrf>\2", body)
    return body


def signature(response: Any, replace: dict[str, str] | None = None) -> dict[str, Any]:
    """Everything a client can observe of an answer, as comparable data.

    `replace` stands in for ids the caller chose, where an answer echoes them: in the
    Location header (a redirect to the object's own URL). The body is compared as is.
    """
    body = without_csrf(body_of(response))
    headers = {k.lower(): v for k, v in response.items() if k.lower() not in VOLATILE_HEADERS}
    for old, new in (replace or {}).items():
        if "location" in headers:
            headers["location"] = whole_word(old).sub(new, headers["location"])
    return {"status": response.status_code, "headers": headers, "body": body}


def whole_word(token: str) -> re.Pattern[str]:
    """`token` as a whole word: id 4 must not match inside "403"."""
    return re.compile(rf"(?<![\w-]){re.escape(token)}(?![\w-])")


def allowed_by_405(response: Any, method: str) -> bool:
    """A 405 that names the allowed methods, without this one: the view refuses the method
    itself, before any lookup (so it cannot be an oracle)."""
    allow = {m.strip().upper() for m in response.get("Allow", "").split(",") if m.strip()}
    return response.status_code == 405 and method not in allow


def markers_in(content: bytes, markers: Iterable[str]) -> list[str]:
    """Which of another tenant's identifying strings appear in an answer (word-bounded, so a
    short marker never matches inside a random token)."""
    text = without_csrf(content).decode("utf-8", "replace")
    text = _PLACEHOLDER.sub("", text)  # example values of the templates ("user:alice")
    return [m for m in markers if re.search(rf"(?<![\w-]){re.escape(m)}(?![\w-])", text, re.I)]


# --- the coverage summary ---------------------------------------------------------------------

SUMMARY: dict[str, Any] = {}
SUMMARY_FILE = Path(settings.BASE_DIR) / "var" / "test" / "isolation-matrix.json"


def record(section: str, **figures: Any) -> None:
    """Add a test's figures to the session summary (written and printed at the end)."""
    SUMMARY.setdefault(section, {}).update(figures)


def write_summary() -> Path | None:
    if not SUMMARY:
        return None
    SUMMARY_FILE.parent.mkdir(parents=True, exist_ok=True)
    data = {"database": connection.vendor, **SUMMARY}
    SUMMARY_FILE.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    return SUMMARY_FILE


def summary_lines() -> list[str]:
    lines = []
    for section, figures in sorted(SUMMARY.items()):
        shown = ", ".join(
            f"{k}={v}" for k, v in sorted(figures.items()) if isinstance(v, int | float | str)
        )
        lines.append(f"{section}: {shown}")
    return lines
