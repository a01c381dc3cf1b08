"""Real worker processes: their histograms reach /metrics exactly, and their log lines are
JSON that says which run, fence and tenant they are about (the slow layer)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from audit.models import JournalEntry
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Run, RunStatus, Tenant
from runtime.sweeper import sweep_once
from tests import procs
from tests.ops.metrics import scrape, value

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

STEPS = "holdpoint_step_duration_seconds_count"


def _json_lines(log: Path) -> list[dict[str, object]]:
    """Every complete line must be JSON; the last one may be cut short.

    The worker is SIGKILLed while its processes log, and Linux ends a write to a regular file
    early at a page boundary when a fatal signal is pending: CI once saw the file end in
    ``..."action_``. A line the kill cut has no newline; a line that has one is held to JSON.
    """
    text = log.read_text()
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.startswith("{")]


def test_worker_histograms_and_log_lines(tenant_a: Tenant, tmp_path: Path) -> None:
    before = value(scrape(), STEPS)
    # One run's steps in this process (a web process observes the same way)…
    here = create_run(tenant_a, "chain", {"steps": 2}, actor="t")
    advance_run(here.run_id, "pytest")
    # …the others' in a real cluster's worker processes.
    runs = [create_run(tenant_a, "chain", {"steps": 3}, actor="t") for _ in range(3)]
    flaky = create_run(tenant_a, "flaky", {"fail_times": 1}, actor="t")
    log = tmp_path / "worker.log"
    committed = JournalEntry.objects.filter(
        stream__in=[f"run:{r.run_id}" for r in [here, *runs, flaky]], type="step_committed"
    )
    worker = procs.start(["qcluster"], procs.child_env(), log=log)
    try:

        def settled() -> bool:
            sweep_once()
            done = Run.objects.filter(
                pk__in=[r.run_id for r in runs], status=RunStatus.COMPLETED
            ).count()
            flaky.refresh_from_db()
            # A worker observes a step just after its commit: the run can read `completed`
            # a moment before the last step is in the worker's histogram file.
            observed = value(scrape(), STEPS) - before == committed.count()
            return done == len(runs) and flaky.status == RunStatus.RETRYING and observed

        procs.wait_for(settled, timeout=90, every=0.5)
    finally:
        procs.kill(worker)  # SIGKILL: what a process observed is in its file already
    actors = set(committed.values_list("actor", flat=True))
    assert any(a.startswith("worker:pytest#") for a in actors) and len(actors) > 1
    assert value(scrape(), STEPS) - before == committed.count() == 2 + 3 * 3

    lines = _json_lines(log)
    assert any(line.get("logger") == "django-q" for line in lines)  # django-q2's own, as JSON
    flaky.refresh_from_db()
    failed = [line for line in lines if line["run_id"] == str(flaky.run_id)]
    assert failed, log.read_text()[-2000:]
    assert all(line["tenant"] == tenant_a.pk and line["fence"] == flaky.fence for line in failed)
    assert any("failed" in str(line["event"]) for line in failed)


def test_metrics_server_answers_like_the_web(tenant_a: Tenant, tmp_path: Path) -> None:
    create_run(tenant_a, "chain", {"steps": 1}, actor="t")
    env = procs.child_env(HOLDPOINT_METRICS_TOKEN="s3cret-token")
    server, base = procs.start_listening(
        lambda port: ["metrics_server", "--port", str(port)], env, tmp_path / "m.log"
    )
    url = f"{base}/metrics"
    try:

        def up() -> httpx.Response | None:
            try:
                return httpx.get(url, headers={"Authorization": "Bearer s3cret-token"})
            except httpx.TransportError:
                return None

        answer = procs.wait_for(up, timeout=60, every=0.2)
        refused = httpx.get(url)
    finally:
        procs.kill(server)
    assert answer.status_code == 200
    assert 'holdpoint_runs{status="queued"} 1.0' in answer.text
    assert refused.status_code == 401 and refused.content == b""


def test_metrics_server_answers_500_and_logs_a_json_line_without_its_database(
    tmp_path: Path,
) -> None:
    """A scrape whose database is away: the web answers 500 and logs it; metrics_server hung
    up with no answer at all (Prometheus saw a connection reset, not the server's error) and
    printed socketserver's plain traceback among its JSON lines."""
    log = tmp_path / "m.log"
    env = procs.child_env(
        DATABASE_URL="postgres://holdpoint@127.0.0.1:1/nowhere", HOLDPOINT_LOG_FORMAT="json"
    )
    server, base = procs.start_listening(
        lambda port: ["metrics_server", "--port", str(port)], env, log
    )
    url = f"{base}/metrics"
    try:

        def up() -> httpx.Response | None:
            try:
                return httpx.get(url, timeout=30)
            except httpx.ConnectError:  # not listening yet
                return None

        answer = procs.wait_for(up, timeout=60, every=0.2)
    finally:
        procs.kill(server)
    assert answer.status_code == 500 and answer.content == b""
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    failed = [line for line in lines if line["logger"] == "holdpoint.metrics"]
    assert failed and "OperationalError" in str(failed[0].get("exception")), lines
