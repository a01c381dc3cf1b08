"""Django admin as tenant A's admin (TEST-MATRIX E4; DESIGN.md invariant 9).

Every admin URL pattern of the resolver × every method, as A's tenant admin (staff, not
superuser; runtime.admin.TenantScopedAdmin and friends), against tenant B's objects:

- changelists (with every search, every filter choice, filters naming B's ids, raw-id
  popups) list A's rows and nothing of B;
- the change form, delete page, history, the object URL and the view-on-site shortcut of B's
  object are indistinguishable from those of an id that does not exist. Django 5.2 answers a
  missing object with a redirect to the admin index and a message naming the id; the
  redirect and the message (id aside) must be the same for B's object;
- the autocomplete endpoint, for every relation of every model to a registered model,
  returns A's rows only;
- admin actions posted with B's ids in `_selected_action` and add forms posted with B's
  tenant, users or groups change nothing;
- operators' tables (users, groups, the task queue) are closed to tenant admins: 403, and no
  existence oracle either.

A model registered tomorrow fails these tests until `ADMIN_MODELS` says whose rows it holds
and how to find tenant B's object of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

import pytest
from django.apps import apps
from django.contrib import admin
from django.contrib.admin.utils import quote
from django.contrib.contenttypes.models import ContentType
from django.contrib.messages import get_messages
from django.db.models import Model
from django.test import Client, RequestFactory

from runtime.models import Role
from tests.api import fresh_throttle  # noqa: F401  (the rate limit must not leak between tests)
from tests.conftest import Persona, make_persona
from tests.security import matrix
from tests.security.admin_models import (
    ADMIN_MODELS,
    OBJECT_VIEWS,
    missing_id,
    model_route,
)
from tests.security.conftest import csrf_client
from tests.security.matrix import METHODS, SAFE, Route
from tests.security.world import World

pytestmark = pytest.mark.django_db


# --- the calling context ------------------------------------------------------------------------


@dataclass
class AdminCtx:
    a: World
    b: World
    client: Client
    token: str
    b_client: Client
    b_token: str
    b_objects: dict[str, Model]
    a_objects: dict[str, Model]
    user: Any
    content_types: dict[str, int]
    failures: list[str] = field(default_factory=list)
    combos: set[tuple[str, str]] = field(default_factory=set)
    requests: int = 0

    def call(
        self, method: str, url: str, body: dict[str, Any] | None = None, b: bool = False
    ) -> Any:
        client, token = (self.b_client, self.b_token) if b else (self.client, self.token)
        client.cookies.pop("messages", None)  # each answer's messages are its own
        self.requests += 1
        if method in SAFE:
            return client.generic(method, url, HTTP_X_CSRFTOKEN=token)
        form = {**(body or {}), "csrfmiddlewaretoken": token}
        return client.generic(
            method,
            url,
            urlencode(form, doseq=True),
            content_type="application/x-www-form-urlencoded",
            HTTP_X_CSRFTOKEN=token,
        )

    def check(self, ok: bool, message: str) -> None:
        if not ok:
            self.failures.append(message)

    def nothing_of_b(self, response: Any, where: str, echo: str = "") -> None:
        markers = [m for m in self.b.markers if m.lower() not in echo.lower()]
        markers += [self.link(label, obj) for label, obj in self.b_objects.items()]
        found = matrix.markers_in(matrix.body_of(response), [m for m in markers if m])
        self.check(not found, f"{where}: tenant B's {found[:5]} in the answer")

    def link(self, label: str, obj: Model) -> str:
        model = apps.get_model(label)
        url_id = ADMIN_MODELS[label].url_id(obj)
        return f"/admin/{model._meta.app_label}/{model._meta.model_name}/{quote(url_id)}/change/"


def answer(response: Any, replace: dict[str, str]) -> dict[str, Any]:
    """The signature of an answer plus the messages it queued, ids replaced."""
    seen = matrix.signature(response, replace)
    texts = []
    for message in get_messages(response.wsgi_request):
        texts.append((message.level, str(message)))
    seen["messages"] = [(level, _replace(text, replace)) for level, text in texts]
    return seen


def _replace(text: str, replace: dict[str, str]) -> str:
    for old, new in replace.items():
        text = matrix.whole_word(old).sub(new, text)
    return text


@pytest.fixture
def admin_ctx(worlds: tuple[World, World], admin_a: Persona) -> AdminCtx:
    a, b = worlds
    from approvals.management.commands.seed_demo import Command

    admin_b = make_persona(b.tenant, "bea", Role.ADMIN, is_staff=True)
    admin_b.user.groups.add(Command()._tenant_admin_group())
    client, token = csrf_client(admin_a.user)
    b_client, b_token = csrf_client(admin_b.user)
    b_objects = {label: spec.obj(b) for label, spec in ADMIN_MODELS.items()}
    a_objects = {label: spec.obj(a) for label, spec in ADMIN_MODELS.items()}
    # Made now, not during a probe: get_for_model creates a proxy model's row on first use.
    content_types = {
        label: ContentType.objects.get_for_model(apps.get_model(label), False).pk
        for label in ADMIN_MODELS
    }
    return AdminCtx(
        a, b, client, token, b_client, b_token, b_objects, a_objects, admin_a.user, content_types
    )


# --- per-model views ----------------------------------------------------------------------------


def probe_object_view(ctx: AdminCtx, route: Route, label: str, view: str, method: str) -> None:
    """B's object and a missing id: the same answer (id aside), nothing changed."""
    model = apps.get_model(label)
    spec = ADMIN_MODELS[label]
    foreign_id = str(spec.url_id(ctx.b_objects[label]))
    missing = spec.missing or missing_id(model)
    name = "id" if "<id>" in route.pattern else "object_id"
    body = {"post": "yes"}  # the delete page's confirmation, harmless elsewhere
    theirs = ctx.call(method, route.url({name: quote(foreign_id)}), body)
    nobody = ctx.call(method, route.url({name: quote(missing)}), body)
    where = f"{method} /{route.pattern} ({label}, B's {foreign_id})"
    same = answer(theirs, {quote(foreign_id): "<id>", foreign_id: "<id>"}) == answer(
        nobody, {quote(missing): "<id>", missing: "<id>"}
    )
    ctx.check(
        same, f"{where}: differs from a missing id ({theirs.status_code}, {nobody.status_code})"
    )
    ctx.check(theirs.status_code != 200, f"{where}: 200 — B's object was shown")
    ctx.combos.add((label, view))


def probe_changelist(ctx: AdminCtx, route: Route, label: str, method: str) -> None:
    spec = ADMIN_MODELS[label]
    url = route.url()
    where = f"{method} /{route.pattern}"
    if spec.owned is None:
        response = ctx.call(method, url, {"action": "delete_selected"})
        ctx.check(response.status_code == 403, f"{where}: {response.status_code}, not 403")
        ctx.combos.add((label, "changelist"))
        return
    if method == "POST":
        probe_actions(ctx, url, label)
        return
    response = ctx.call(method, url)
    ctx.check(response.status_code == 200, f"{where}: {response.status_code}")
    ctx.nothing_of_b(response, where)
    ctx.combos.add((label, "changelist"))
    if method != "GET":
        return
    own = ctx.link(label, ctx.a_objects[label])
    ctx.check(own.encode() in response.content, f"{where}: A's own row missing")
    for term in search_terms(ctx, label):
        found = ctx.call("GET", f"{url}?{urlencode({'q': term})}")
        ctx.nothing_of_b(found, f"{where}?q={term}", echo=term)
    ctx.combos.add((label, "search"))
    for query in filter_queries(ctx, response, label):
        found = ctx.call("GET", url + query)
        ctx.check(found.status_code in (200, 302), f"{where}{query}: {found.status_code}")
        ctx.nothing_of_b(found, f"{where}{query}", echo=query)
    ctx.combos.add((label, "filters"))
    pk = apps.get_model(label)._meta.pk.attname
    for query in ("?_popup=1", f"?_popup=1&_to_field={pk}"):
        popup = ctx.call("GET", url + query)
        ctx.check(popup.status_code == 200, f"{where}{query}: {popup.status_code}")
        ctx.nothing_of_b(popup, f"{where}{query}")
    ctx.combos.add((label, "raw_id_popup"))
    mine = ctx.call("GET", own)
    ctx.check(mine.status_code == 200, f"GET {own}: {mine.status_code} (A's own object)")


def search_terms(ctx: AdminCtx, label: str) -> list[str]:
    b = ctx.b
    obj = ctx.b_objects[label]
    return [
        b.slug,
        b.reviewer.user.get_username(),
        b.agent.user.get_username(),
        str(obj),
        str(obj.pk),
    ]


def filter_queries(ctx: AdminCtx, response: Any, label: str) -> list[str]:
    """Every choice of every filter the changelist offers, and each relation filter pointed
    at B's related object."""
    queries: list[str] = []
    changelist = response.context["cl"]
    for spec in changelist.filter_specs:
        queries += [choice["query_string"] for choice in spec.choices(changelist)]
    model_admin = admin.site._registry[apps.get_model(label)]
    b_obj = ctx.b_objects[label]
    for item in model_admin.list_filter:
        name = item[0] if isinstance(item, tuple) else item
        if not isinstance(name, str):
            continue
        field_ = apps.get_model(label)._meta.get_field(name)
        if field_.is_relation:
            related = getattr(b_obj, field_.attname, None)
            queries.append(f"?{name}__{field_.target_field.attname}__exact={related}")
    return queries


def probe_actions(ctx: AdminCtx, url: str, label: str) -> None:
    """Every action offered to A's admin, posted with B's id and with a missing id."""
    model = apps.get_model(label)
    model_admin = admin.site._registry[model]
    request = RequestFactory().get(url)
    request.user = ctx.user
    names = list(model_admin.get_actions(request)) or ["delete_selected"]
    foreign = str(ctx.b_objects[label].pk)
    missing = missing_id(model)
    for name in names:
        answers = []
        for pk in (foreign, missing):
            body = {"action": name, "_selected_action": pk, "index": 0, "post": "yes"}
            answers.append(answer(ctx.call("POST", url, body), {pk: "<id>"}))
        ctx.check(answers[0] == answers[1], f"POST {url} action {name}: B's id is an oracle")
    ctx.combos.add((label, "actions"))


def probe_add(ctx: AdminCtx, route: Route, label: str, method: str) -> None:
    """The add form offers nothing of B; posted with B's tenant, users, groups and parents it
    creates nothing (the form refuses choices outside A)."""
    where = f"{method} /{route.pattern}"
    if method != "POST":
        response = ctx.call(method, route.url())
        if ADMIN_MODELS[label].owned is None:
            ctx.check(response.status_code == 403, f"{where}: {response.status_code}, not 403")
        else:
            ctx.check(response.status_code in (200, 403), f"{where}: {response.status_code}")
            ctx.nothing_of_b(response, where)
        ctx.combos.add((label, "add"))
        return
    b = ctx.b
    forged = {
        "tenant": b.tenant.pk,
        "user": b.reviewer.user.pk,
        "role": Role.ADMIN,
        "webhook": b.webhook.pk,
        "policy": b.policy.pk,
        "escalation_group": ctx.b_objects["auth.Group"].pk,
        "decider_groups": ctx.b_objects["auth.Group"].pk,
        "username": "forged-by-a",
        "is_active": "on",
        "name": "forged-by-a",
        "tool": "tasks.create",
        "url": "https://forged.example/hook",
        "event_types": "approval.requested",
        "quorum": 1,
        "expiry_seconds": 60,
        "on_expiry": "reject",
        "remind_before_seconds": 10,
        "priority": 1,
    }
    response = ctx.call("POST", route.url(), forged)
    ctx.check(response.status_code in (200, 403), f"{where}: {response.status_code} (saved?)")
    ctx.combos.add((label, "add_forged"))


# --- site-wide views ----------------------------------------------------------------------------


def probe_autocomplete(ctx: AdminCtx, route: Route, method: str) -> None:
    """Every relation of every model to a registered model: A's rows only."""
    url = route.url()
    if method != "GET":
        # Without its parameters the view refuses (403), or the method is refused (405);
        # OPTIONS describes the view. Nothing of any tenant either way.
        response = ctx.call(method, url)
        ctx.check(
            response.status_code in (200, 403, 405), f"{method} {url}: {response.status_code}"
        )
        ctx.nothing_of_b(response, f"{method} {url}")
        return
    for model in apps.get_models():
        for field_ in [*model._meta.fields, *model._meta.many_to_many]:
            remote = field_.remote_field.model if field_.is_relation else None
            if remote not in admin.site._registry:
                continue
            label = remote._meta.label
            query = {
                "app_label": model._meta.app_label,
                "model_name": model._meta.model_name,
                "field_name": field_.name,
            }
            for term in ("", ctx.b.slug, ctx.b.reviewer.user.get_username()):
                response = ctx.call("GET", f"{url}?{urlencode({**query, 'term': term})}")
                where = f"autocomplete {model._meta.label}.{field_.name} → {label} term={term!r}"
                spec = ADMIN_MODELS.get(label)
                if spec is None:
                    ctx.failures.append(f"{where}: {label} missing from ADMIN_MODELS")
                    continue
                if spec.owned is None or response.status_code in (403, 404):
                    # 403: no view permission on the target; 404: its admin has no
                    # search_fields (Django refuses before listing anything).
                    ctx.check(
                        response.status_code in (403, 404), f"{where}: {response.status_code}"
                    )
                    continue
                ctx.check(response.status_code == 200, f"{where}: {response.status_code}")
                ids = {str(item["id"]) for item in response.json()["results"]}
                to_field = field_.remote_field.get_related_field().attname  # type: ignore[union-attr]
                own = {str(v) for v in spec.owned(ctx.a.tenant).values_list(to_field, flat=True)}
                ctx.check(ids <= own, f"{where}: foreign rows {sorted(ids - own)[:3]}")
                if not term:
                    ctx.check(bool(ids), f"{where}: A's rows missing")
            ctx.combos.add((label, f"autocomplete:{model._meta.label}.{field_.name}"))


def probe_view_on_site(ctx: AdminCtx, route: Route, method: str) -> None:
    """The shortcut looks objects up by content type and id: B's must read as missing."""
    for label, obj in ctx.b_objects.items():
        model = apps.get_model(label)
        ct = ctx.content_types[label]
        foreign = str(model._meta.pk.value_from_object(obj))
        missing = missing_id(model)
        theirs = ctx.call(method, route.url({"content_type_id": ct, "object_id": foreign}))
        nobody = ctx.call(method, route.url({"content_type_id": ct, "object_id": missing}))
        same = answer(theirs, {foreign: "<id>"}) == answer(nobody, {missing: "<id>"})
        ctx.check(same, f"{method} view-on-site {label} B's {foreign}: an oracle")
        ctx.combos.add((label, "view_on_site"))


def probe_site_page(ctx: AdminCtx, route: Route, method: str) -> None:
    """Index, app indexes, login, password pages, jsi18n, unknown paths: nothing of B, and
    the same answer for B's admin where the page names no one."""
    if route.key == "app_list":
        labels = {m._meta.app_label for m in admin.site._registry}
        urls = [f"/admin/{app}/" for app in sorted(labels)]
    elif route.pattern.endswith("(?P<url>.*)$"):
        urls = ["/admin/no-such-page/", f"/admin/runtime/run/{ctx.b.run_id}/change/"]
    else:
        urls = [route.url()]
    for url in urls:
        response = ctx.call(method, url)
        where = f"{method} {url}"
        ctx.check(response.status_code != 500, f"{where}: 500")
        ctx.nothing_of_b(response, where)


# (pattern key, method) pairs with no isolation probe, and why.
EXEMPT = {
    ("logout", "POST"): "ends the caller's own session",
    ("password_change", "POST"): "changes the caller's own password (web-security tests)",
    ("password_change", "PUT"): "FormView handles PUT as POST: the caller's own password",
    ("login", "POST"): "authentication itself (web-security tests)",
    ("login", "PUT"): "FormView handles PUT as POST: a login attempt",
}
SITE_PROBES: dict[str, Callable[[AdminCtx, Route, str], None]] = {
    "index": probe_site_page,
    "login": probe_site_page,
    "logout": probe_site_page,
    "password_change": probe_site_page,
    "password_change_done": probe_site_page,
    "jsi18n": probe_site_page,
    "app_list": probe_site_page,
    "admin/(?P<url>.*)$": probe_site_page,
    "autocomplete": probe_autocomplete,
    "view_on_site": probe_view_on_site,
}


def probe(ctx: AdminCtx, route: Route, method: str) -> bool:
    """Probe one admin pattern with one method; False if the tests do not know it."""
    found = model_route(route)
    if found is not None:
        label, view = found
        if view.startswith("unknown:"):
            ctx.failures.append(f"/{route.pattern}: an admin view the tests do not know")
            return False
        if view in OBJECT_VIEWS:
            probe_object_view(ctx, route, label, view, method)
        elif view == "changelist":
            probe_changelist(ctx, route, label, method)
        else:
            probe_add(ctx, route, label, method)
        return True
    if route.key in SITE_PROBES:
        SITE_PROBES[route.key](ctx, route, method)
        return True
    ctx.failures.append(f"/{route.pattern} ({route.key}): add it to SITE_PROBES")
    return False


# Above the database as the URL matrix is (its scoping is the admin's querysets): CI's pair
# runs it once, on SQLite, and the URL matrix on PostgreSQL (tests/ci_pair.py).
@pytest.mark.ci_database("sqlite")
def test_every_admin_url_model_and_view_is_isolated(admin_ctx: AdminCtx) -> None:
    ctx = admin_ctx
    own = matrix.sessions_of(ctx.client, ctx.b_client)  # the callers' session rows
    routes = [r for r in matrix.all_routes() if r.area == "admin"]
    registered = {model._meta.label for model in admin.site._registry}
    assert registered <= set(ADMIN_MODELS), f"add to ADMIN_MODELS: {registered - set(ADMIN_MODELS)}"

    covered: set[tuple[str, str]] = set()
    exempt: set[tuple[str, str]] = set()
    # Each route's "after" snapshot is the next route's "before": nothing happens between the
    # two (a snapshot of every table takes ~7 ms; one per route is saved).
    after = matrix.db_state(own)
    for route in routes:
        before = after
        for method in METHODS:
            if (route.key, method) in EXEMPT:
                exempt.add((route.pattern, method))
            elif probe(ctx, route, method):
                covered.add((route.pattern, method))
        after = matrix.db_state(own)
        changed = matrix.changed_tables(before, after)
        ctx.check(not changed, f"/{route.pattern}: the probes changed {changed}")

    views = {view for _, view in ctx.combos}
    per_model = {label: sorted(v for m, v in ctx.combos if m == label) for label in registered}
    matrix.record(
        "admin",
        admin_url_patterns=len(routes),
        admin_url_method_combinations=len(routes) * len(METHODS),
        admin_url_method_covered=len(covered),
        admin_url_method_exempt=len(exempt),
        admin_models=len(registered),
        admin_model_view_combinations=len(ctx.combos),
        admin_view_kinds=len(views),
        requests=ctx.requests,
        failures=len(ctx.failures),
        per_model=per_model,
    )
    assert not ctx.failures, "\n".join(ctx.failures[:200])
    enumerated = {(r.pattern, m) for r in routes for m in METHODS}
    assert covered == enumerated - exempt, sorted(enumerated - exempt - covered)[:20]
    # Each registered model was probed through each of its views.
    for label in registered:
        expected = {"changelist", "add", "change", "delete", "history", "object", "view_on_site"}
        if ADMIN_MODELS[label].owned is not None:
            expected |= {"search", "filters", "raw_id_popup", "actions", "add_forged"}
        missing = expected - set(per_model[label])
        assert not missing, f"{label}: views not probed {missing}"
