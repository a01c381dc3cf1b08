"""Log lines say what they are about: JSON with run_id/action_id/fence/tenant, bound where a
request is authenticated or a run advanced; a readable line for `make run`."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime import logs
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Run, Tenant
from tests.conftest import Persona
from tests.core.readme import blocks


@pytest.fixture
def lines() -> Iterator[io.StringIO]:
    """Lines formatted as they are emitted (the contextvars of that moment), as production."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.formatter("json"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield out
    finally:
        root.removeHandler(handler)


def _parsed(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_an_api_request_line_carries_its_tenant_and_run(
    agent_a: Persona, tenant_b: Tenant, lines: io.StringIO
) -> None:
    foreign = create_run(tenant_b, "chain", {"steps": 1}, actor="t")
    lines.truncate(0)
    response = agent_a.api().get(f"/api/v1/runs/{foreign.run_id}/")
    assert response.status_code == 404
    refused = [e for e in _parsed(lines) if "cross-tenant" in str(e["event"])]
    assert len(refused) == 1
    assert refused[0]["tenant"] == agent_a.tenant.pk
    assert refused[0]["run_id"] == str(foreign.run_id)
    assert refused[0]["action_id"] is None and refused[0]["fence"] is None


def test_a_worker_line_carries_run_fence_and_tenant(tenant_a: Tenant, lines: io.StringIO) -> None:
    run = create_run(tenant_a, "flaky", {"fail_times": 1}, actor="t")
    with logs.scope():
        advance_run(run.run_id, "w1")
    run.refresh_from_db()
    failed = [e for e in _parsed(lines) if e["logger"] == "holdpoint.executor"]
    assert failed and all(
        e["run_id"] == str(run.run_id)
        and e["fence"] == run.fence == 1
        and e["tenant"] == tenant_a.pk
        for e in failed
    )
    assert Run.objects.get(pk=run.run_id).status == "retrying"


def test_the_readme_log_line_is_the_line_a_worker_writes(
    tenant_a: Tenant, lines: io.StringIO
) -> None:
    """The README's example line (Metrics and logs) is a real one: the same fields, the same
    logger and level, the same words — only the run's id and the time differ."""
    (block,) = [b for b in blocks() if b.lang == "json" and '"logger"' in b.text]
    shown = json.loads(block.text)
    run = create_run(tenant_a, "flaky", {"fail_times": 1}, actor="t")
    with logs.scope():
        advance_run(run.run_id, "w1")
    (line,) = [e for e in _parsed(lines) if e["logger"] == shown["logger"]]
    assert set(line) == set(shown)
    assert line["level"] == shown["level"]
    assert line["event"] == str(shown["event"]).replace("0b8f…", str(run.run_id))
    assert (line["tenant"], line["fence"], line["action_id"]) == (tenant_a.pk, 1, None)


def test_nothing_bound_outlives_its_scope(tenant_a: Tenant, lines: io.StringIO) -> None:
    with logs.scope():
        logs.bind_lease("r1", tenant_a.pk, 3)
    logging.getLogger("holdpoint.test").warning("after")
    (line,) = _parsed(lines)
    assert (line["run_id"], line["fence"], line["tenant"]) == (None, None, None)


def test_a_queue_task_leaves_nothing_bound_for_the_workers_next_lines(
    tenant_a: Tenant, lines: io.StringIO
) -> None:
    """A django-q2 worker process runs task after task in one thread: what a task bound (its
    run, fence, action) must not label the lines that follow — django-q2's "processing …"
    of the next task, another run's notification — as that run's. Seen in `make run`'s log:
    every later line of the process carried the first run's ids."""
    from runtime import tasks

    run = create_run(tenant_a, "flaky", {"fail_times": 1}, actor="t")
    tasks.advance(str(run.run_id))  # as the worker calls it: no scope of the test's own
    logging.getLogger("holdpoint.test").warning("the next task starts")
    *during, after = _parsed(lines)
    assert any(e["run_id"] == str(run.run_id) for e in during), "the task's lines name it"
    assert after["event"] == "the next task starts"
    assert (after["run_id"], after["action_id"], after["fence"], after["tenant"]) == (
        None,
        None,
        None,
        None,
    )


def test_console_format_is_one_readable_line() -> None:
    record = logging.LogRecord(
        "holdpoint.x", logging.INFO, __file__, 1, "run %s done", ("r1",), None
    )
    with logs.scope():
        logs.bind_lease("r1", 7, 2)
        text = logs.formatter("console").format(record)
    assert "\n" not in text and "run r1 done" in text and "fence=2" in text and "{" not in text
    with pytest.raises(ValueError):
        logs.formatter("xml")


_SAY = (
    "import django, logging; django.setup(); "
    "logging.getLogger('holdpoint.test').warning('hello %s', 'there')"
)


def _logged(stderr_to_terminal: bool, **extra: str) -> str:
    """What a process writes to its stderr — a pseudo-terminal, or a pipe — for one line."""
    import os
    import pty
    import subprocess
    import sys

    from tests.procs import ROOT, child_env

    env = child_env()
    env.pop("HOLDPOINT_LOG_FORMAT", None)  # unless the test says: the default
    env.update(extra)
    if not stderr_to_terminal:
        done = subprocess.run(
            [sys.executable, "-c", _SAY], cwd=ROOT, env=env, capture_output=True, timeout=60
        )
        return done.stderr.decode()
    leader, follower = pty.openpty()
    try:
        subprocess.run([sys.executable, "-c", _SAY], cwd=ROOT, env=env, stderr=follower, timeout=60)
        os.close(follower)
        out = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the terminal's other side is closed and drained
                break
            if not chunk:
                break
            out += chunk
        return out.decode()
    finally:
        os.close(leader)


def test_the_default_format_is_readable_on_a_terminal_and_json_elsewhere() -> None:
    """A person running manage.py in a terminal reads lines, not JSON; a worker whose
    stderr is a file, a pipe or a collector writes JSON; HOLDPOINT_LOG_FORMAT decides when
    it is set."""
    on_terminal = _logged(True).strip()
    assert "hello there" in on_terminal and not on_terminal.startswith("{"), on_terminal
    [piped] = [json.loads(line) for line in _logged(False).splitlines() if line.strip()]
    assert piped["event"] == "hello there" and piped["logger"] == "holdpoint.test"
    said = _logged(True, HOLDPOINT_LOG_FORMAT="json").strip()
    assert json.loads(said)["event"] == "hello there"


@pytest.mark.parametrize("format", logs.FORMATS)
def test_a_tracebacks_locals_never_reach_a_log_line(agent_a: Persona, format: str) -> None:
    """An API request whose token lookup meets a lost database is a 503, and the operator
    gets its traceback — in both formats without the frames' local variables: the console
    renderer printed them when `rich` is installed (the test extra brings it, and `make run`
    logs in console format), and the frame that reads the header holds the agent's key."""
    from django.db import OperationalError, connection

    def lost(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if "agenttoken" in sql.lower():
            raise OperationalError("server closed the connection unexpectedly")
        return execute(sql, params, many, context)

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.formatter(format))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with connection.execute_wrapper(lost):
            answer = agent_a.api().get("/api/v1/runs/")
    finally:
        root.removeHandler(handler)
    assert answer.status_code == 503  # service_unavailable (tests/api/test_database_lost.py)
    written = out.getvalue()
    assert "OperationalError" in written and "server closed the connection" in written
    assert agent_a.token and agent_a.token not in written
    assert agent_a.token[:12] not in written  # not even the part a truncated repr shows


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_every_line_of_the_production_web_is_json(tmp_path: Path) -> None:
    """`uvicorn config.asgi:application` (production's web) with the JSON format: its own
    lines — start-up, each request's access line, shutdown — are JSON objects like Django's,
    not uvicorn's `INFO:     …` text among them (a log pipeline reading one JSON object per
    line dropped or choked on them)."""
    import signal

    import httpx

    from tests import procs

    log = tmp_path / "web.log"
    server, base = procs.start_web(procs.child_env(HOLDPOINT_LOG_FORMAT="json"), log)
    try:
        assert httpx.get(base + "/healthz", timeout=30).status_code == 200
        assert httpx.get(base + "/api/v1/runs/", timeout=30).status_code == 401
    finally:
        procs.kill(server, signal.SIGTERM)
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    parsed = [json.loads(line) for line in lines]  # every line, or this raises
    events = [str(line["event"]) for line in parsed]
    assert any('"GET /healthz HTTP/1.1" 200' in event for event in events), events
    assert any(line["logger"] == "uvicorn.access" for line in parsed)
    assert "Application shutdown complete." in events
    assert all(set(logs.FIELDS) <= set(line) for line in parsed)
