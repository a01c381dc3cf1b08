"""The isolation matrix (TEST-MATRIX E1, E2; DESIGN.md invariant 9): every URL pattern of
the resolver and every operation of the OpenAPI document, × every HTTP method, called as
tenant A — agent token on the API, reviewer / viewer / admin browser sessions with CSRF on
pages and API — on tenant B's objects.

- A route with object ids in its path is called with each of B's objects of that kind and
  with ids that name nothing: both answers must be 404 (or the method's own 405) and
  identical in status, headers and bytes — no existence oracle — and nothing in the
  database may change.
- A route without object ids is a collection (lists, filters, cursors, counts, exports, the
  audit log) or a probe: it gets an explicit check that A sees only A's rows.
- Admin routes are probed by test_admin_isolation.py, which accounts for each of them.

A new route fails these tests until `KWARG_KINDS`, `BODIES` or `LIST_CHECKS` says how to
probe it, or `EXEMPT` says (with a reason) why it needs no probe.

The existing API-only matrix (tests/api/test_isolation.py) stays as the API suite's own
check; this one spans every area and every method.
"""

from __future__ import annotations

import base64
import csv
import io
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

import pytest
from django.core.cache import cache
from django.test import Client
from hypothesis import given, settings
from hypothesis import strategies as st

from approvals.models import ApprovalRequest, ApprovalStatus
from runtime import tooldefs
from runtime.api.base import Cursor
from runtime.models import Action, ActionStatus, Run, RunStatus, ToolDefinition
from tests.api import fresh_throttle  # noqa: F401  (the rate limit must not leak between tests)
from tests.conftest import Persona
from tests.security import matrix
from tests.security.conftest import csrf_client, token_client
from tests.security.matrix import METHODS, SAFE, Route
from tests.security.world import World, random_ids, tool_of

pytestmark = pytest.mark.django_db

# Which of tenant B's objects a path parameter names. A parameter not listed here fails
# the matrix: say what it names, and the world must have objects of that kind.
KWARG_KINDS = {
    "run_id": "run",
    "action_id": "action",
    "request_id": "approval",
    "approval_id": "approval",
    "name": "tool",  # tools/{name}/: the tenant's own tool definition
    "rev": "checkpoint",  # always together with run_id: B's run and one of its revs
}
# Who calls which area. Sessions are real browser sessions: CSRF enforced, token sent.
CALLERS = {"api": ("agent", "reviewer", "viewer"), "page": ("reviewer", "viewer", "admin")}
HX = {"HTTP_HX_REQUEST": "true"}
_keys = itertools.count()


def _hash_of(approval_id: Any) -> str:
    found = ApprovalRequest.objects.filter(pk=approval_id).values_list("action_hash", flat=True)
    return found.first() or "0" * 64


# Bodies that would succeed on B's object if scoping were missing (so a 404 proves the
# scoping, not a validation error). Keyed by route name; used for every unsafe method.
BODIES: dict[str, Callable[[dict[str, Any], World], dict[str, Any]]] = {
    "api-revisions": lambda v, w: {"goal": {"x": 1}, "expected_goal_rev": 1},
    "api-input": lambda v, w: {"data": {"title": "x"}, "expected_rev": 1},
    "api-cancel": lambda v, w: {"reason": "probe"},
    "api-resume": lambda v, w: {},
    "api-checkpoints": lambda v, w: {
        "fence": w.fence,
        "expected_rev": 1,
        "state": {},
        "next_step": "x",
    },
    "api-run-actions": lambda v, w: {
        "fence": w.fence,
        "tool": "tasks.create",
        "params": {"title": "probe"},
    },
    "api-lease": lambda v, w: {"owner": "intruder", "ttl_seconds": 30},
    "api-heartbeat": lambda v, w: {"fence": w.fence},
    "api-release": lambda v, w: {"fence": w.fence},
    "api-dispatch": lambda v, w: {"fence": w.fence},
    "api-outcome": lambda v, w: {"fence": w.fence, "outcome": "confirmed", "external_id": "X"},
    "api-resolve": lambda v, w: {"outcome": "applied", "external_id": "X"},
    "api-decision": lambda v, w: {
        "decision": "approve",
        "action_hash": _hash_of(v["approval_id"]),
    },
    "approval-page-decide": lambda v, w: {
        "decision": "approve",
        "action_hash": _hash_of(v["request_id"]),
        "reason": "probe",
    },
    "api-tool": lambda v, w: {**tool_of(w.slug), "name": v["name"], "expected_version": 1},
    "run-cancel": lambda v, w: {"reason": "probe"},
    "run-resume": lambda v, w: {},
    "run-input": lambda v, w: {"input": "{}", "expected_rev": "1"},
    "run-revise": lambda v, w: {"goal": "{}", "expected_goal_rev": "1"},
    "run-executor": lambda v, w: {"executor_account": w.agent.user.get_username()},
    "reconcile-resolve": lambda v, w: {"outcome": "applied", "external_id": "X"},
    "action-compensate": lambda v, w: {"reason": "probe"},
    "action-send-again": lambda v, w: {},
}

# (route, method) pairs that need no isolation probe, and why.
EXEMPT: dict[tuple[str, str], str] = {
    ("login", "POST"): "authentication itself: names no tenant object; lockout and session "
    "rotation are the web-security tests' subject",
    ("login", "PUT"): "Django's FormView handles PUT as POST: the same login attempt",
    ("logout", "POST"): "ends the caller's own session only; the web-security tests' subject",
    ("password_change", "POST"): "changes the caller's own password; web-security tests",
    ("password_change", "PUT"): "FormView handles PUT as POST: the caller's own password",
}


# --- the calling context ----------------------------------------------------------------------


@dataclass
class Ctx:
    a: World
    b: World
    clients: dict[str, tuple[Client, str | None]]
    b_clients: dict[str, tuple[Client, str | None]]
    probes: int = 0
    failures: list[str] = field(default_factory=list)
    # The last `db_state` and the sessions it left out, until the next request: a route's
    # "after" is the next one's "before" (a snapshot of every table takes ~7 ms, and the
    # matrix writes nothing but through `call`).
    snapshot: tuple[frozenset[str], dict[str, tuple[int, str]]] | None = None

    def own_sessions(self) -> set[str]:
        """The callers' own session rows (their expiry is renewed on every request)."""
        pool = [*self.clients.values(), *self.b_clients.values()]
        return matrix.sessions_of(*(client for client, _ in pool))

    def db_state(self) -> dict[str, tuple[int, str]]:
        """`matrix.db_state` now: taken afresh unless no request was sent since the last."""
        own = frozenset(self.own_sessions())
        if self.snapshot is None or self.snapshot[0] != own:
            self.snapshot = (own, matrix.db_state(own))
        return self.snapshot[1]

    def call(
        self,
        caller: str,
        method: str,
        url: str,
        body: dict[str, Any] | None = None,
        *,
        area: str = "page",
        tenant: str = "a",
        **extra: Any,
    ) -> Any:
        """One request as `caller` of tenant A (or the matching caller of tenant B)."""
        pool = self.clients if tenant == "a" else self.b_clients
        client, token = pool[caller if caller in pool else "session"]
        if token:
            extra["HTTP_X_CSRFTOKEN"] = token
        cache.clear()  # the per-token rate limit is tested elsewhere; a 429 must not mask a 404
        self.probes += 1
        self.snapshot = None  # the request may write
        if method in SAFE:
            return client.generic(method, url, **extra)
        if area == "api":
            extra.setdefault("HTTP_IDEMPOTENCY_KEY", f"probe-{next(_keys)}")
            data = json.dumps(body or {})
            return client.generic(method, url, data, content_type="application/json", **extra)
        form = dict(body or {})
        if token:
            form["csrfmiddlewaretoken"] = token
        data = urlencode(form, doseq=True)
        return client.generic(
            method, url, data, content_type="application/x-www-form-urlencoded", **extra
        )

    def check(self, ok: bool, message: str) -> None:
        if not ok:
            self.failures.append(message)

    def no_markers(self, response: Any, where: str, echo: str = "") -> None:
        """None of B's identifying strings in the answer (except what the request itself
        carried, such as a filter value the page shows back in its form)."""
        markers = [m for m in self.b.markers if m.lower() not in echo.lower()]
        found = matrix.markers_in(matrix.body_of(response), markers)
        self.check(not found, f"{where}: tenant B's {found} in the answer")


@pytest.fixture
def ctx(
    worlds: tuple[World, World], viewer_a: Persona, admin_a: Persona, outsider_b: Persona
) -> Ctx:
    a, b = worlds
    clients: dict[str, tuple[Client, str | None]] = {
        "agent": (token_client(a.agent), None),
        "reviewer": csrf_client(a.reviewer.user),
        "viewer": csrf_client(viewer_a.user),
        "admin": csrf_client(admin_a.user),
    }
    b_clients: dict[str, tuple[Client, str | None]] = {
        "agent": (token_client(b.agent), None),
        "session": csrf_client(outsider_b.user),
    }
    return Ctx(a, b, clients, b_clients)


# --- object routes: B's ids against ids that name nothing --------------------------------------


def candidates(route: Route, b: World) -> list[dict[str, Any]]:
    """Every combination of B's objects the route's path parameters can name."""
    if "rev" in route.kwargs:
        return b.checkpoints()
    if len(route.kwargs) != 1:
        raise AssertionError(f"/{route.pattern}: two objects in one path; add a rule here")
    (name,) = route.kwargs
    return [{name: pk} for pk in b.ids(KWARG_KINDS[name])]


def probe_object_route(ctx: Ctx, route: Route, covered: set[tuple[str, str]]) -> None:
    before = ctx.db_state()
    for caller, method in itertools.product(CALLERS[route.area], METHODS):
        where = f"{method} /{route.pattern} as {caller}"
        missing_ids = random_ids()
        body_of = BODIES.get(route.key)
        for values in candidates(route, ctx.b):
            body = body_of(values, ctx.b) if body_of else {}
            missing = ctx.call(caller, method, route.url(missing_ids), body, area=route.area)
            refused = matrix.allowed_by_405(missing, method)
            if method not in SAFE and not refused and body_of is None:
                ctx.failures.append(f"{where}: answers {missing.status_code}; add it to BODIES")
            foreign = ctx.call(caller, method, route.url(values), body, area=route.area)
            same = matrix.signature(foreign) == matrix.signature(missing)
            ctx.check(same, f"{where}: B's {values} answers differently from a missing id")
            if refused or method == "OPTIONS":
                # 405: the method is refused before any lookup. OPTIONS describes the
                # endpoint, not an object (identical for every id, asserted above).
                ctx.check(foreign.status_code in (200, 405), f"{where}: {foreign.status_code}")
            else:
                ctx.check(foreign.status_code == 404, f"{where}: {foreign.status_code}, not 404")
                if route.area == "api" and method != "HEAD":
                    code = foreign.json().get("code") if foreign.status_code == 404 else None
                    ctx.check(code == "not_found", f"{where}: problem code {code}")
        covered.add((route.pattern, method))
    changed = matrix.changed_tables(before, ctx.db_state())
    ctx.check(not changed, f"/{route.pattern}: probes changed {changed}")


# --- collection routes: A's rows only ------------------------------------------------------------

Check = Callable[[Ctx, Route, str, str], None]


def _ids_in(results: list[dict[str, Any]], key: str) -> set[str]:
    return {str(item[key]) for item in results}


def same_for_everyone(ctx: Ctx, route: Route, caller: str, method: str) -> None:
    """A probe, a redirect, the API's own description: the same answer for A and B."""
    mine = ctx.call(caller, method, route.url(), area=route.area)
    theirs = ctx.call(caller, method, route.url(), area=route.area, tenant="b")
    where = f"{method} /{route.pattern} as {caller}"
    ctx.check(mine.status_code != 500, f"{where}: {mine.status_code}")
    ctx.check(matrix.signature(mine) == matrix.signature(theirs), f"{where}: differs for A and B")
    ctx.no_markers(mine, where)


def deployment_wide(ctx: Ctx, route: Route, caller: str, method: str) -> None:
    """/readyz and /metrics: the deployment's live figures (they move between two calls, so
    they are not compared), never a tenant's names."""
    response = ctx.call(caller, method, route.url(), area=route.area)
    where = f"{method} /{route.pattern} as {caller}"
    ctx.check(response.status_code in (200, 503), f"{where}: {response.status_code}")
    ctx.no_markers(response, where)


def shows_nothing_of_b(ctx: Ctx, route: Route, caller: str, method: str) -> None:
    response = ctx.call(caller, method, route.url(), area=route.area)
    where = f"{method} /{route.pattern} as {caller}"
    ctx.check(response.status_code < 400, f"{where}: {response.status_code}")
    ctx.no_markers(response, where)


def _page(
    ctx: Ctx, route: Route, caller: str, method: str, query: str, echo: str = "", **extra: Any
) -> Any:
    response = ctx.call(caller, method, route.url() + query, **extra)
    where = f"{method} /{route.pattern}{query} as {caller}"
    ctx.check(response.status_code == 200, f"{where}: {response.status_code}")
    ctx.no_markers(response, where, echo=query + " " + echo)
    return response


def inbox(ctx: Ctx, route: Route, caller: str, method: str) -> None:
    extra = HX if route.key == "inbox-list" else {}
    b = ctx.b
    pending = ApprovalRequest.objects.filter(tenant=ctx.a.tenant, status=ApprovalStatus.PENDING)
    parked = Action.objects.filter(tenant=ctx.a.tenant, status=ActionStatus.MANUAL_REVIEW)
    for query in ("", "?tool=tasks.close", f"?policy={b.policy.pk}", "?mine=1", "?tool=x"):
        response = _page(ctx, route, caller, method, query, **extra)
        if query or method != "GET":
            continue
        where = f"/{route.pattern} as {caller}"
        ctx.check(ctx.a.approval_id.encode() in response.content, f"{where}: A's card missing")
        counts = response.context["counts"]
        ctx.check(counts["total"] == pending.count(), f"{where}: counts {counts}")
        ctx.check(response.context["parked_count"] == parked.count(), f"{where}: parked count")


def history(ctx: Ctx, route: Route, caller: str, method: str) -> None:
    for query in ("", "?page=2", "?page=last"):
        response = _page(ctx, route, caller, method, query)
        if not query and method == "GET":
            found = ctx.a.decided_id.encode() in response.content
            ctx.check(found, f"/{route.pattern} as {caller}: A's decided request missing")


def runs_page(ctx: Ctx, route: Route, caller: str, method: str) -> None:
    b = ctx.b
    queries = ("", f"?thread_id=thread-of-{b.slug}", "?graph=chain", "?status=running", "?page=2")
    for query in queries:
        response = _page(ctx, route, caller, method, query)
        if not query and method == "GET":
            found = all(pk.encode() in response.content for pk in ctx.a.ids("run"))
            ctx.check(found, f"/{route.pattern} as {caller}: A's runs missing")


def start_run_page(ctx: Ctx, route: Route, caller: str, method: str) -> None:
    """Starting a run from the page: the run is A's whatever tenant the form claims."""
    b = ctx.b
    b_before = matrix.tenant_state(b.tenant.pk)
    form = {
        "graph": "chain",
        "goal": '{"steps": 1}',
        "thread_id": f"started-by-{caller}",
        "tenant": b.tenant.pk,
        "tenant_id": b.tenant.pk,
    }
    response = ctx.call(caller, method, route.url(), form)
    where = f"{method} /{route.pattern} as {caller}"
    started = Run.objects.filter(thread_id=f"started-by-{caller}")
    if caller == "viewer":
        ctx.check(response.status_code == 403, f"{where}: {response.status_code}")
        ctx.check(not started.exists(), f"{where}: a viewer started a run")
    else:
        ctx.check(response.status_code == 302, f"{where}: {response.status_code}")
        ctx.check([r.tenant_id for r in started] == [ctx.a.tenant.pk], f"{where}: tenant")
    ctx.check(matrix.tenant_state(b.tenant.pk) == b_before, f"{where}: B's rows changed")


def reconcile_list(ctx: Ctx, route: Route, caller: str, method: str) -> None:
    for query in ("", "?page=2"):
        response = _page(ctx, route, caller, method, query)
        if not query and method == "GET":
            found = ctx.a.parked_id.encode() in response.content
            ctx.check(found, f"/{route.pattern} as {caller}: A's parked action missing")


def audit_log(ctx: Ctx, route: Route, caller: str, method: str) -> None:
    b = ctx.b
    b_entry = max(b.journal_ids())
    a_actor = f"agent:{ctx.a.agent.user.get_username()}"
    queries = (
        "",
        f"?actor=agent:{b.agent.user.get_username()}",
        f"?object=run:{b.run_id}",
        f"?object={b.run_id}",
        "?type=approval_decided",
        f"?before={b_entry}",
        f"?before={b_entry + 1}",
        "?to=2999-12-31",
    )
    echo = " ".join(_typed_filters(b))
    for query in queries:
        response = _page(ctx, route, caller, method, query, echo=echo)
        if not query and method == "GET":
            found = a_actor.encode() in response.content
            ctx.check(found, f"/{route.pattern} as {caller}: A's entries missing")
    # A period pages by (created_at, id): B's entry id as the cursor must read exactly like
    # an id that is nobody's ("not an entry of this tenant"), not like a real position.
    missing = 2**62
    foreign = ctx.call(caller, method, f"{route.url()}?from=2000-01-01&before={b_entry}")
    nobody = ctx.call(caller, method, f"{route.url()}?from=2000-01-01&before={missing}")
    seen = [
        (r.status_code, r.context["problems"], len(r.context["rows"])) for r in (foreign, nobody)
    ]
    ctx.check(seen[0] == seen[1], f"{method} /{route.pattern} as {caller}: B's cursor {seen}")


def overview(ctx: Ctx, route: Route, caller: str, method: str) -> None:
    """The overview's figures count A's rows only (B has runs, requests and a parked action
    too), and none of B's runs is listed."""
    response = _page(ctx, route, caller, method, "")
    if method != "GET":
        return
    seen = response.context["overview"]
    tenant = ctx.a.tenant
    where = f"/{route.pattern} as {caller}"
    ctx.check(seen.runs_total == Run.objects.filter(tenant=tenant).count(), f"{where}: runs")
    pending = ApprovalRequest.objects.filter(tenant=tenant, status=ApprovalStatus.PENDING)
    ctx.check(seen.waiting_total == pending.count(), f"{where}: waiting approvals")
    parked = Action.objects.filter(tenant=tenant, status=ActionStatus.MANUAL_REVIEW)
    ctx.check(seen.manual_review == parked.count(), f"{where}: reconciliation backlog")
    ctx.check(all(r.tenant_id == tenant.pk for r in seen.attention), f"{where}: B's runs")


def _typed_filters(b: World) -> tuple[str, ...]:
    """Filters naming B's things that A types into the audit log and the exports. An export
    records its filters in A's own stream (audit_exported), so later pages and exports show
    them back: A's own words, not B's data."""
    return (f"?object=run:{b.run_id}", f"?actor=agent:{b.agent.user.get_username()}")


def export(ctx: Ctx, route: Route, caller: str, method: str) -> None:
    """Exports hold A's entries only (and record themselves in A's stream, nowhere else)."""
    b = ctx.b
    b_before = matrix.tenant_state(b.tenant.pk)
    echo = " ".join(_typed_filters(b))
    for query in ("", *_typed_filters(b)):
        response = ctx.call(caller, method, route.url() + query)
        where = f"{method} /{route.pattern}{query} as {caller}"
        ctx.check(response.status_code == 200, f"{where}: {response.status_code}")
        ctx.no_markers(response, where, echo=echo)
        body = matrix.body_of(response).decode()
        if route.key.endswith("csv"):
            rows = list(csv.DictReader(io.StringIO(body)))
        else:
            rows = [json.loads(line) for line in body.splitlines() if line]
        ids = {int(row["id"]) for row in rows}
        own = ctx.a.journal_ids()  # the export itself was recorded first
        ctx.check(ids <= own, f"{where}: foreign entries {sorted(ids - own)[:5]}")
        if not query and method == "GET":
            ctx.check(len(ids) >= 20, f"{where}: A's entries missing ({len(ids)})")
        if query:
            ctx.check(not ids, f"{where}: {len(ids)} entries for B's filter")
    ctx.check(matrix.tenant_state(b.tenant.pk) == b_before, f"{route.pattern}: B changed")


def switch_tenant(ctx: Ctx, route: Route, caller: str, method: str) -> None:
    """Switching to B's tenant is the same 404 as switching to a tenant that does not exist,
    and the session stays in A."""
    b = ctx.b
    answers = {
        value: ctx.call(caller, method, route.url(), {"tenant": value, "next": "/runs/"})
        for value in (b.tenant.pk, 987654321, "x")
    }
    where = f"{method} /{route.pattern} as {caller}"
    signatures = [matrix.signature(r) for r in answers.values()]
    ctx.check(all(s == signatures[0] for s in signatures), f"{where}: B's tenant is an oracle")
    ctx.check(answers[b.tenant.pk].status_code == 404, f"{where}: not 404")
    runs = ctx.call(caller, "GET", "/runs/")
    ctx.check(ctx.a.run_id.encode() in runs.content, f"{where}: the session left tenant A")
    ctx.no_markers(runs, where)


def _api_list(ctx: Ctx, caller: str, url: str) -> list[dict[str, Any]]:
    response = ctx.call(caller, "GET", url, area="api")
    ctx.check(response.status_code == 200, f"GET {url} as {caller}: {response.status_code}")
    ctx.no_markers(response, f"GET {url} as {caller}", echo=url)
    return response.json().get("results", []) if response.status_code == 200 else []


def _forged_cursor(position: str, reverse: bool = False) -> str:
    tokens = {"p": position, **({"r": "1"} if reverse else {})}
    return base64.b64encode(urlencode(tokens).encode()).decode()


def _cursors(ctx: Ctx, route: Route, caller: str, key: str, own: set[str]) -> None:
    """B's own `next` links replayed by A, and positions forged from B's rows: A's rows or
    nothing, never B's. A cursor that is not a cursor is a 400."""
    url = route.url()
    b_page = ctx.call("agent", "GET", url, area="api", tenant="b").json()
    replay: str | None = b_page.get("next")
    ctx.check(bool(replay), f"{url}: B has a second page to replay")
    pages = 0
    while replay and pages < 10:
        results = _api_list(ctx, caller, replay)
        ctx.check(_ids_in(results, key) <= own, f"{url} replayed as {caller}: foreign rows")
        replay = ctx.call(caller, "GET", replay, area="api").json().get("next")
        pages += 1
    for item in b_page.get("results", []):
        for reverse in (False, True):
            forged = f"{url}?cursor={_forged_cursor(str(item['created_at']), reverse)}"
            results = _api_list(ctx, caller, forged)
            ctx.check(_ids_in(results, key) <= own, f"{forged} as {caller}: foreign rows")
    garbage = ctx.call(caller, "GET", f"{url}?cursor=bm90IGEgY3Vyc29y", area="api")
    ctx.check(garbage.status_code in (200, 400), f"{url} garbage cursor: {garbage.status_code}")


def _api_collection(
    ctx: Ctx, route: Route, caller: str, method: str, key: str, own: set[str], queries: tuple
) -> None:
    if method == "HEAD":
        response = ctx.call(caller, method, route.url(), area="api")
        ctx.check(response.status_code == 200, f"HEAD /{route.pattern}: {response.status_code}")
        return
    for query in queries:
        results = _api_list(ctx, caller, route.url() + query)
        ids = _ids_in(results, key)
        ctx.check(ids <= own, f"GET /{route.pattern}{query} as {caller}: foreign rows")
        if not query:
            ctx.check(ids == own, f"GET /{route.pattern} as {caller}: A's rows missing")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Cursor, "page_size", 1)
        _cursors(ctx, route, caller, key, own)


def api_runs(ctx: Ctx, route: Route, caller: str, method: str) -> None:
    own = {str(pk) for pk in Run.objects.filter(tenant=ctx.a.tenant).values_list("pk", flat=True)}
    b = ctx.b
    queries = ("", f"?thread_id=thread-of-{b.slug}", "?graph=asker", "?status=running")
    _api_collection(ctx, route, caller, method, "run_id", own, queries)


def api_actions(ctx: Ctx, route: Route, caller: str, method: str) -> None:
    own = {
        str(pk) for pk in Action.objects.filter(tenant=ctx.a.tenant).values_list("pk", flat=True)
    }
    b = ctx.b
    queries = ("", f"?idempotency_key={b.idempotency_key}", "?tool=tasks.close", "?status=sent")
    _api_collection(ctx, route, caller, method, "action_id", own, queries)


def api_approvals(ctx: Ctx, route: Route, caller: str, method: str) -> None:
    own = {
        str(pk)
        for pk in ApprovalRequest.objects.filter(tenant=ctx.a.tenant).values_list("pk", flat=True)
    }
    queries = ("", "?status=pending", "?status=rejected")
    _api_collection(ctx, route, caller, method, "id", own, queries)


def api_tools(ctx: Ctx, route: Route, caller: str, method: str) -> None:
    """The built-ins and A's own definitions; B's never (its name carries B's slug)."""
    if method == "HEAD":
        response = ctx.call(caller, method, route.url(), area="api")
        ctx.check(response.status_code == 200, f"HEAD /{route.pattern}: {response.status_code}")
        return
    names = {tool["name"] for tool in _api_list(ctx, caller, route.url())}
    own = set(tooldefs.builtin_specs()) | set(
        ToolDefinition.objects.filter(tenant=ctx.a.tenant).values_list("name", flat=True)
    )
    ctx.check(names == own, f"GET /{route.pattern} as {caller}: {sorted(names ^ own)}")


def api_define_tool(ctx: Ctx, route: Route, caller: str, method: str) -> None:
    """Nobody the matrix calls as is A's admin: refused, and neither tenant's tools move —
    not even with B's tool's name and B's tenant in the body."""
    b = ctx.b
    before = {t: matrix.tenant_state(t.pk) for t in (ctx.a.tenant, b.tenant)}
    body = {**tool_of(b.slug), "tenant": b.tenant.pk, "tenant_id": b.tenant.pk}
    response = ctx.call(caller, method, route.url(), body, area="api")
    where = f"{method} /{route.pattern} as {caller}"
    ctx.check(response.status_code == 403, f"{where}: {response.status_code}, not 403")
    for tenant, state in before.items():
        ctx.check(matrix.tenant_state(tenant.pk) == state, f"{where}: {tenant.slug} changed")


def api_create_run(ctx: Ctx, route: Route, caller: str, method: str) -> None:
    """A run created through the API is the caller's tenant's, whatever the body claims."""
    b = ctx.b
    b_before = matrix.tenant_state(b.tenant.pk)
    body = {
        "graph": "chain",
        "goal": {"steps": 1},
        "external": True,
        "thread_id": f"api-started-by-{caller}",
        "tenant": b.tenant.pk,
        "tenant_id": b.tenant.pk,
    }
    response = ctx.call(caller, method, route.url(), body, area="api")
    where = f"{method} /{route.pattern} as {caller}"
    started = Run.objects.filter(thread_id=f"api-started-by-{caller}")
    ctx.check(response.status_code in (201, 403), f"{where}: {response.status_code}")
    ctx.check(all(r.tenant_id == ctx.a.tenant.pk for r in started), f"{where}: tenant")
    ctx.check(matrix.tenant_state(b.tenant.pk) == b_before, f"{where}: B's rows changed")


LIST_CHECKS: dict[str, dict[str, Check]] = {
    # RedirectView answers every method with the same redirect to the inbox.
    "": {m: same_for_everyone for m in METHODS},
    "login": {"GET": shows_nothing_of_b},
    "password_change": {"GET": shows_nothing_of_b},
    "password_change_done": {"GET": shows_nothing_of_b},
    "inbox": {"GET": inbox},
    "inbox-list": {"GET": inbox},
    "inbox-history": {"GET": history},
    "overview": {"GET": overview},
    "switch-tenant": {"POST": switch_tenant},
    "runs": {"GET": runs_page, "POST": start_run_page},
    "reconcile": {"GET": reconcile_list},
    "audit-log": {"GET": audit_log},
    "audit-export-csv": {"GET": export},
    "audit-export-jsonl": {"GET": export},
    "healthz": {"GET": same_for_everyone},
    "readyz": {"GET": deployment_wide},
    "metrics": {"GET": deployment_wide},
    "api-runs": {"GET": api_runs, "POST": api_create_run},
    "api-actions": {"GET": api_actions},
    "api-approvals": {"GET": api_approvals},
    "api-tools": {"GET": api_tools, "POST": api_define_tool},
    "api-schema": {"GET": same_for_everyone},
    "api-docs": {"GET": same_for_everyone},
}


def check_for(route: Route, method: str) -> Check | None:
    checks = LIST_CHECKS.get(route.key, {})
    if method in checks:
        return checks[method]
    if method == "HEAD" and "GET" in checks:
        return checks["GET"]  # HEAD is GET without the body
    if method == "OPTIONS":
        return same_for_everyone  # describes the endpoint, the same for everyone
    return None


def probe_collection_route(ctx: Ctx, route: Route, covered: set[tuple[str, str]]) -> None:
    """Each method: refused with 405 (the view does not implement it), or the route's
    check; an implemented method without a check fails."""
    if route.key not in LIST_CHECKS and not any(k == route.key for k, _ in EXEMPT):
        ctx.failures.append(f"/{route.pattern} ({route.key}): add it to LIST_CHECKS or EXEMPT")
        return
    for method in METHODS:
        if (route.key, method) in EXEMPT:
            continue
        writes = (route.key, "GET" if method == "HEAD" else method) in WRITERS
        before = ctx.db_state()
        for caller in CALLERS[route.area]:
            response = ctx.call(caller, method, route.url(), {}, area=route.area)
            check = check_for(route, method)
            if not matrix.allowed_by_405(response, method):
                if check is None:
                    ctx.failures.append(
                        f"{method} /{route.pattern}: answers {response.status_code}; "
                        "add a check to LIST_CHECKS"
                    )
                else:
                    check(ctx, route, caller, method)
        if not writes:
            changed = matrix.changed_tables(before, ctx.db_state())
            ctx.check(not changed, f"{method} /{route.pattern}: changed {changed}")
        covered.add((route.pattern, method))


# Checks that write A's own rows on purpose (and assert B's rows unchanged themselves):
# starting a run, and the audit exports, which record themselves (an `audit_exported` entry
# in the exporting tenant's stream, committed before the first byte) — the journal of a
# read, not a change of any object; test_no_state_change_through_get.py pins that entry.
WRITERS = {
    ("runs", "POST"),
    ("api-runs", "POST"),
    ("audit-export-csv", "GET"),
    ("audit-export-jsonl", "GET"),
}


# --- the matrix -------------------------------------------------------------------------------


# Scoping is the querysets' (runtime.tenancy.scope), the same SQL on both databases, which
# the API and page tests run on both: CI's pair runs this matrix once, on PostgreSQL — the
# production shape — and the admin matrix on SQLite (tests/ci_pair.py; ~100 s each).
@pytest.mark.ci_database("postgresql")
def test_every_url_and_method_is_isolated(ctx: Ctx) -> None:
    routes = matrix.all_routes()
    probed = [r for r in routes if r.area != "admin"]
    unknown = sorted(
        {name for r in probed for name in r.kwargs if name not in KWARG_KINDS}
        | {r.pattern for r in probed if r.is_regex}
    )
    assert not unknown, f"path parameters or regex routes the matrix cannot fill: {unknown}"

    covered: set[tuple[str, str]] = set()
    for route in probed:
        if route.kwargs:
            probe_object_route(ctx, route, covered)
        else:
            probe_collection_route(ctx, route, covered)

    enumerated = {(r.pattern, m) for r in probed for m in METHODS}
    exempt = {(r.pattern, m) for r in probed for m in METHODS if (r.key, m) in EXEMPT}
    matrix.record(
        "urls",
        url_patterns=len(routes),
        url_patterns_probed_here=len(probed),
        url_patterns_admin=len(routes) - len(probed),
        url_method_combinations=len(enumerated),
        url_method_covered=len(covered),
        url_method_exempt=len(exempt),
        object_routes=sum(1 for r in probed if r.kwargs),
        requests=ctx.probes,
        failures=len(ctx.failures),
        exempt={f"{m} {k}": reason for (k, m), reason in EXEMPT.items()},
    )
    assert not ctx.failures, "\n".join(ctx.failures[:300])
    assert covered == enumerated - exempt, sorted(enumerated - exempt - covered)[:20]


def test_the_openapi_document_and_the_resolver_agree() -> None:
    """Every operation the OpenAPI document describes is a resolver route the matrix probes
    with that method; every API route and method the views implement is documented."""
    routes = {matrix.openapi_path(r): r for r in matrix.all_routes() if r.area == "api"}
    operations = matrix.openapi_operations()
    assert operations, "the schema lists no operations"
    unknown = sorted(path for path, _ in operations if path not in routes)
    assert not unknown, f"OpenAPI paths no route serves: {unknown}"
    undocumented = []
    for path, route in routes.items():
        if route.key in ("api-schema", "api-docs"):
            continue  # the document itself and its viewer
        view = route.callback.view_class
        implemented = {
            m for m in ("GET", "POST", "PUT", "PATCH", "DELETE") if hasattr(view, m.lower())
        }
        undocumented += [f"{m} {path}" for m in implemented if (path, m) not in operations]
    assert not undocumented, undocumented
    matrix.record("openapi", operations=len(operations), paths=len({p for p, _ in operations}))


# --- generated filters ---------------------------------------------------------------------------

LISTS = {
    "/api/v1/runs/": ("run_id", Run, {"status": RunStatus.values, "thread_id": [], "graph": []}),
    "/api/v1/actions/": (
        "action_id",
        Action,
        {"status": ActionStatus.values, "tool": [], "idempotency_key": []},
    ),
    "/api/v1/approvals/": ("id", ApprovalRequest, {"status": ApprovalStatus.values}),
}


def test_generated_filters_never_return_another_tenants_rows(ctx: Ctx) -> None:
    """TEST-MATRIX E2: filter values drawn from both tenants' own words (their thread ids,
    graphs, tools, idempotency keys, every status) and arbitrary text, combined at random,
    on every list: A's rows or a 422, never one of B's."""
    a, b = ctx.a, ctx.b
    words = {
        "thread_id": [f"thread-of-{a.slug}", f"thread-of-{b.slug}"],
        "graph": ["chain", "asker"],
        "tool": ["tasks.create", "tasks.close"],
        "idempotency_key": [a.idempotency_key, b.idempotency_key],
    }
    text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=30)
    examples = 0

    @settings(max_examples=120, deadline=None, derandomize=True)
    @given(
        data=st.data(), url=st.sampled_from(sorted(LISTS)), caller=st.sampled_from(CALLERS["api"])
    )
    def probe(data: st.DataObject, url: str, caller: str) -> None:
        nonlocal examples
        key, model, fields = LISTS[url]
        query = {}
        for name, values in fields.items():
            choices = [*values, *words.get(name, [])]
            value = data.draw(st.none() | st.sampled_from(choices) | text, label=name)
            if value is not None:
                query[name] = value
        response = ctx.call(caller, "GET", f"{url}?{urlencode(query)}", area="api")
        own = {str(pk) for pk in model.objects.filter(tenant=a.tenant).values_list("pk", flat=True)}
        assert response.status_code in (200, 422), (query, response.status_code)
        if response.status_code == 200:
            found = _ids_in(response.json()["results"], key)
            assert found <= own, (url, query, found - own)
        examples += 1

    probe()
    matrix.record("urls", generated_filter_queries=examples)


def test_a_viewer_cannot_start_a_run_through_the_api(viewer_a: Persona) -> None:
    client, token = csrf_client(viewer_a.user)
    body = json.dumps({"graph": "chain", "goal": {"steps": 1}})
    response = client.post(
        "/api/v1/runs/", body, content_type="application/json", HTTP_X_CSRFTOKEN=token
    )
    assert response.status_code == 403, response.status_code
    assert not Run.objects.filter(tenant=viewer_a.tenant).exists()
