"""/readyz answers "can do useful work": database, migrations, a live worker cluster; its
details are `manage.py doctor`'s checks (tests/core/test_doctor.py)."""

from __future__ import annotations

import io
import signal
from pathlib import Path

import httpx
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

from runtime.models import Tenant
from tests import procs
from tests.tooldefs import define_tickets


@pytest.mark.django_db
def test_readyz_unavailable_without_a_worker(client: Client) -> None:
    response = client.get("/readyz")
    body = response.json()
    assert response.status_code == 503
    assert body["checks"]["database"]["ok"] is True
    assert body["checks"]["migrations"] == {"ok": True, "pending": []}
    assert body["checks"]["worker"]["ok"] is False


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_readyz_ready_while_a_cluster_runs(client: Client, tmp_path: object) -> None:
    worker = procs.start(["qcluster"], procs.child_env())
    try:
        ready = procs.wait_for(
            lambda: (r := client.get("/readyz")).status_code == 200 and r.json(), timeout=60
        )
        assert ready["checks"]["worker"]["clusters"]
        # With a worker up, the test settings pass every check doctor makes (SQLite or
        # PostgreSQL, as CI runs them), and /readyz reports each of them as passed.
        out = io.StringIO()
        call_command("doctor", stdout=out)
        assert out.getvalue().splitlines() == [f"All {len(ready['checks'])} checks pass."]
        assert all(check["ok"] for check in ready["checks"].values()), ready
        # A warning (a write tool no policy names: held by default) is said, and fails
        # doctor only when asked to.
        define_tickets(Tenant.objects.create(slug="acme", name="Acme"), "http://127.0.0.1:9")
        out = io.StringIO()
        call_command("doctor", stdout=out)
        said = out.getvalue().splitlines()
        assert said[0].startswith("WARNING write_policies: ") and "acme/tickets.create" in said[0]
        assert said[-1] == f"{len(ready['checks'])} checks: no errors, 1 warning(s)."
        with pytest.raises(CommandError):
            call_command("doctor", "--fail-level", "warning", stdout=io.StringIO())
    finally:
        procs.kill(worker)
    procs.wait_for(lambda: client.get("/readyz").status_code == 503, timeout=30)


@pytest.mark.slow
def test_readyz_fails_when_the_database_is_unreachable() -> None:
    closed = procs.free_port()  # nothing listens there
    env = procs.child_env(DATABASE_URL=f"postgres://nobody@127.0.0.1:{closed}/nowhere")
    # The production server: runserver itself refuses to start without a database.
    server, base = procs.start_web(env)
    try:
        procs.wait_for(lambda: _get(base + "/healthz"), timeout=60)
        alive = httpx.get(base + "/healthz")
        assert alive.status_code == 200
        ready = httpx.get(base + "/readyz", timeout=30)
        assert ready.status_code == 503
        checks = ready.json()["checks"]
        assert checks["database"]["ok"] is False
        assert "OperationalError" in checks["database"]["detail"]
        # A probe anyone can reach is not told where the database is, nor as whom: the
        # driver's message (host, port, user, database) stays with `manage.py doctor`.
        told = ready.text
        assert str(closed) not in told and "nobody" not in told and "nowhere" not in told
    finally:
        procs.kill(server)


def _get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=2)
    except httpx.HTTPError:
        return None


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_asgi_server_serves_pages_static_files_and_the_api(tmp_path: Path) -> None:
    """What `make run` and production serve: uvicorn over config.asgi, Django behind it."""
    log = tmp_path / "web.log"
    server, base = procs.start_web(procs.child_env(), log)
    try:
        login = httpx.get(base + "/login/", timeout=30)
        assert login.status_code == 200
        assert "Log in" in login.text
        assert login.headers["x-frame-options"] == "DENY"  # Django's middleware ran
        css = httpx.get(base + "/static/holdpoint/app.css", timeout=30)
        assert css.status_code == 200
        assert css.headers["content-type"].startswith("text/css")
        api = httpx.get(base + "/api/v1/runs/", timeout=30)
        assert api.status_code == 401
        assert api.headers["content-type"] == "application/problem+json"
        assert httpx.get(base + "/nowhere/", timeout=30).status_code == 404
        # This process keeps no connections (config/asgi.py); the workers do, and that is
        # what the connections check reports here too.
        ready = httpx.get(base + "/readyz", timeout=30).json()
        assert ready["checks"]["connections"]["ok"] is True, ready["checks"]["connections"]
    finally:
        procs.kill(server, signal.SIGTERM)
    # A graceful stop (uvicorn re-raises the signal after it, hence no exit status 0).
    assert "Application shutdown complete." in log.read_text()
