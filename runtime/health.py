"""Liveness and readiness probes for supervisors and load balancers.

/healthz says the process answers. /readyz says it can do useful work: the database answers,
every migration is applied, and a worker cluster has published a heartbeat recently (a web
process without workers would accept runs that never move).
"""

from __future__ import annotations

from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.migrations.executor import MigrationExecutor
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_GET


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


def _check_database() -> dict[str, Any]:
    try:
        connection = connections[DEFAULT_DB_ALIAS]
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Exception as exc:  # any driver error means "not reachable" to a probe
        return {"ok": False, "detail": f"{type(exc).__name__}: {exc}".strip()[:200]}
    return {"ok": True}


def _check_migrations() -> dict[str, Any]:
    try:
        connection = connections[DEFAULT_DB_ALIAS]
        executor = MigrationExecutor(connection)
        plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    except Exception as exc:
        return {"ok": False, "detail": f"{type(exc).__name__}"}
    pending = [f"{m.app_label}.{m.name}" for m, _ in plan]
    return {"ok": not pending, "pending": pending}


def _check_cluster() -> dict[str, Any]:
    from django_q.status import Stat

    try:
        stats = Stat.get_all()
    except Exception as exc:  # a broken cache/broker is "no worker seen"
        return {"ok": False, "detail": f"{type(exc).__name__}"}
    clusters = sorted({str(s.cluster_id) for s in stats})
    return {"ok": bool(clusters), "clusters": clusters}


@require_GET
def readyz(request: HttpRequest) -> JsonResponse:
    checks = {"database": _check_database()}
    if checks["database"]["ok"]:
        checks["migrations"] = _check_migrations()
    else:
        checks["migrations"] = {"ok": False, "detail": "database unreachable"}
    checks["worker"] = _check_cluster()
    ready = all(check["ok"] for check in checks.values())
    return JsonResponse(
        {"status": "ok" if ready else "unavailable", "checks": checks}, status=200 if ready else 503
    )
