"""No state change through GET (OWASP ASVS 3.5.3; NOTES.md: mail scanners and link
prefetchers open links before people do).

Every URL pattern of the resolver — pages, API, admin, probes — is called with GET and HEAD
by an authorized user of the owning tenant, with that tenant's valid ids (every run, action,
approval and checkpoint of the tenant; every registered admin model's object), and the
database must not change. Compared: every row of every table (matrix.db_state), except the
caller's own session row, whose expiry each request renews (the inactivity timeout).

One GET writes by design, and exactly this: an audit export records itself — one
`audit_exported` entry in the exporting tenant's stream, committed before the first byte
leaves — because an export is the kind of read an auditor asks about. It changes no object
and cannot be steered (its payload is the filters the caller typed). Anything else written
by a GET fails this test.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import urlencode

import pytest
from django.apps import apps
from django.contrib import admin
from django.contrib.admin.utils import quote
from django.contrib.auth import get_user_model
from django.contrib.contenttypes.models import ContentType

from audit.models import JournalEntry
from tests.api import fresh_throttle  # noqa: F401  (the rate limit must not leak between tests)
from tests.conftest import Persona
from tests.security import matrix
from tests.security.admin_models import ADMIN_MODELS, OBJECT_VIEWS, model_route
from tests.security.conftest import csrf_client, token_client
from tests.security.matrix import Route
from tests.security.world import World

pytestmark = pytest.mark.django_db

EXPORTS = {"audit-export-csv", "audit-export-jsonl"}


def object_values(route: Route, world: World) -> list[dict[str, Any]]:
    """Every combination of the tenant's own objects the route's parameters can name."""
    if "rev" in route.kwargs:
        return world.checkpoints()
    if "name" in route.kwargs:  # tools/{name}/: a built-in and the tenant's own
        return [{"name": "tasks.create"}, {"name": world.tool_name}]
    kinds = {"run_id": "run", "action_id": "action", "request_id": "approval"}
    kinds["approval_id"] = "approval"
    (name,) = route.kwargs
    return [{name: pk} for pk in world.ids(kinds[name])]


def admin_urls(route: Route, world: World, objects: dict[str, Any]) -> Iterator[str]:
    found = model_route(route)
    if found is not None:
        label, view = found
        if view not in OBJECT_VIEWS:
            yield route.url()
            return
        name = "id" if "<id>" in route.pattern else "object_id"
        yield route.url({name: quote(ADMIN_MODELS[label].url_id(objects[label]))})
        return
    if route.key == "app_list":
        yield from sorted({f"/admin/{m._meta.app_label}/" for m in admin.site._registry})
    elif route.key == "view_on_site":
        for label, obj in objects.items():
            model = apps.get_model(label)
            ct = ContentType.objects.get_for_model(model, for_concrete_model=False).pk
            pk = model._meta.pk.value_from_object(obj)
            yield route.url({"content_type_id": ct, "object_id": pk})
    elif route.key == "autocomplete":
        for model in apps.get_models():
            for field in [*model._meta.fields, *model._meta.many_to_many]:
                if field.is_relation and field.remote_field.model in admin.site._registry:
                    query = {
                        "app_label": model._meta.app_label,
                        "model_name": model._meta.model_name,
                        "field_name": field.name,
                    }
                    yield f"{route.url()}?{urlencode(query)}"
    elif route.is_regex:
        yield "/admin/no-such-page/"
    else:
        yield route.url()


def urls_of(route: Route, world: World, objects: dict[str, Any]) -> list[str]:
    if route.area == "admin":
        return list(admin_urls(route, world, objects))
    if route.kwargs:
        return [route.url(values) for values in object_values(route, world)]
    return [route.url()]


def callers_of(route: Route) -> list[str]:
    if route.area == "admin":
        found = model_route(route)
        operator = found is not None and ADMIN_MODELS[found[0]].owned is None
        return ["operator"] if operator else ["tenant_admin", "operator"]
    return ["agent", "reviewer"] if route.area == "api" else ["reviewer", "tenant_admin"]


@pytest.mark.ci_database("sqlite")
def test_get_and_head_change_nothing(
    worlds: tuple[World, World], admin_a: Persona, settings: Any
) -> None:
    """CI runs it on SQLite (tests/ci_pair.py): whether a GET or HEAD writes is the code's
    doing, the same on both databases (it compares rows before and after)."""
    a, _ = worlds
    root = get_user_model().objects.create_superuser("root", password="pw-root")
    clients = {
        "agent": token_client(a.agent),
        "reviewer": csrf_client(a.reviewer.user)[0],
        "tenant_admin": csrf_client(admin_a.user)[0],
        "operator": csrf_client(root)[0],
    }
    objects = {label: spec.obj(a) for label, spec in ADMIN_MODELS.items()}
    for model in apps.get_models():  # made now: a proxy's row appears on first lookup
        ContentType.objects.get_for_model(model, for_concrete_model=False)

    failures: list[str] = []
    calls = 0
    combos: set[tuple[str, str]] = set()
    routes = matrix.all_routes()
    # Each route's "after" snapshot is the next route's "before": nothing but reads happens
    # between the two (a snapshot of every table takes ~7 ms; one per route is saved).
    after = matrix.db_state(matrix.sessions_of(*clients.values()))
    for route in routes:
        before = after
        entries = set(JournalEntry.objects.values_list("pk", flat=True))
        exports = 0
        for method in ("GET", "HEAD"):
            for caller in callers_of(route):
                for url in urls_of(route, a, objects):
                    response = clients[caller].generic(method, url)
                    calls += 1
                    if response.status_code == 500:
                        failures.append(f"{method} {url} as {caller}: 500")
                    if route.key in EXPORTS and response.status_code == 200:
                        exports += 1
            combos.add((route.pattern, method))
        after = matrix.db_state(matrix.sessions_of(*clients.values()))
        changed = matrix.changed_tables(before, after)
        if route.key in EXPORTS:
            failures += export_records(f"/{route.pattern}", changed, entries, exports, a)
        elif changed:
            failures.append(f"GET/HEAD /{route.pattern}: changed {changed}")
    matrix.record(
        "no_state_change_through_get",
        url_patterns=len(routes),
        url_method_combinations=len(combos),
        requests=calls,
        failures=len(failures),
    )
    assert not failures, "\n".join(failures[:100])
    assert combos == {(r.pattern, m) for r in routes for m in ("GET", "HEAD")}


def export_records(
    where: str, changed: list[str], before: set[int], exports: int, world: World
) -> list[str]:
    """Each export added exactly its own record to the exporting tenant's stream."""
    new = list(JournalEntry.objects.exclude(pk__in=before))
    problems = []
    if set(changed) - {"audit_journalentry", "audit_streamhead"}:
        problems.append(f"{where}: changed {changed}")
    shape = {(e.type, e.stream, e.tenant_id) for e in new}
    if len(new) != exports or shape != {
        ("audit_exported", f"tenant:{world.tenant.pk}", world.tenant.pk)
    }:
        problems.append(f"{where}: {exports} exports wrote {len(new)} entries {shape}")
    return problems
