"""Every exception of a step is a counted step failure — in its body, in what it returns, in
its update, or in its commit: counted, backed off, journalled with the error, shown as
`last_error` over the API and on the run page, and after `max_failures` the run needs
attention with the reason (issue 15.2; TEST-MATRIX.md, reach wave G3).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Checkpoint, Run, RunStatus, Tenant
from runtime.sweeper import sweep_once
from tests import procs
from tests.conftest import Persona
from tests.runtime import failing  # noqa: F401  (registers the graph in this process)
from tests.runtime.helpers import make_due, payloads

# What last_error and the journal must say for each way of failing.
ERRORS = {
    "not_json": "NotStorable: $.when: datetime is not a JSON value",
    "raise": "RuntimeError: the tracker said no",
    "commit": "IntegrityError",
}


# Its run's rev 1 is a row written by hand, as no step would (tests/conftest.py would name it).
COMMIT = pytest.param("commit", marks=pytest.mark.tampers_journal)


def _start(tenant: Tenant, how: str) -> Run:
    run = create_run(tenant, "failing", {"how": how}, actor="user:t")
    if how == "commit":
        # A commit the database refuses: the checkpoint rev the step's commit would write
        # is taken already (unique (run, rev)), so every attempt's commit fails there.
        Checkpoint.objects.create(
            run=run,
            tenant=tenant,
            rev=1,
            goal_rev=1,
            status=RunStatus.RUNNING,
            state={},
            created_by="test:taken",
            fence=0,
            digest="0" * 64,
        )
    return run


def _assert_escalated(run: Run, how: str, reviewer: Persona) -> None:
    run.refresh_from_db()
    assert run.status == RunStatus.NEEDS_ATTENTION
    assert run.consecutive_failures == 3 and run.attempts == 3
    # Each attempt took the lease once: the fence counts attempts, not lease TTLs.
    assert run.fence == 3 and len(payloads(run, "lease_taken")) == 3
    assert run.lease_owner == "" and run.lease_expires_at is None
    assert ERRORS[how] in run.last_error
    assert "3 consecutive failure(s) at step attempt" in run.attention_reason
    assert ERRORS[how] in run.attention_reason
    failed = payloads(run, "step_failed")
    assert [f["failures"] for f in failed] == [1, 2, 3]
    assert all(ERRORS[how] in f["error"] for f in failed)
    assert [f["status"] for f in failed] == ["retrying", "retrying", "needs_attention"]
    assert all(f["retry_in_seconds"] > 0 for f in failed[:2])

    api = reviewer.api().get(reverse("api-run", args=[run.run_id]))
    assert api.status_code == 200
    assert ERRORS[how] in api.json()["last_error"]
    assert api.json()["status"] == "needs_attention"
    page = Client()
    page.force_login(reviewer.user)
    html = page.get(reverse("run", args=[run.run_id])).content.decode()
    assert "Last error:" in html and _escaped(ERRORS[how]) in html
    assert "Needs attention:" in html


def _escaped(text: str) -> str:
    from django.utils.html import escape

    return str(escape(text))


@pytest.mark.parametrize("how", ["not_json", "raise", COMMIT])
def test_each_failure_is_counted_then_escalated(
    how: str, tenant_a: Tenant, reviewer_a: Persona
) -> None:
    run = _start(tenant_a, how)
    outcomes = []
    for _ in range(3):
        outcomes.append(advance_run(run.run_id, "w1").outcome)
        run.refresh_from_db()
        if run.status == RunStatus.RETRYING:
            assert run.wake_at is not None and run.lease_owner == ""  # backed off
            make_due(run)
    assert outcomes == ["retrying", "retrying", "needs_attention"]
    assert advance_run(run.run_id, "w1").outcome == "skipped"  # nothing after escalation
    _assert_escalated(run, how, reviewer_a)


def test_bad_values_are_named_where_they_are(tenant_a: Tenant) -> None:
    from datetime import date

    from runtime.graphs import Next, Wait, unstorable

    def error_of(outcome: Any) -> str:
        from audit.canonical import CanonicalError

        return str(unstorable(outcome, CanonicalError("$: somewhere")))

    assert error_of(Next("x", {"a": {"b": [1, {1, 2}]}})) == "$.a.b[1]: set is not a JSON value"
    assert error_of(Next("x", {"n": float("nan")})) == "$.n: NaN and Infinity are not JSON"
    assert error_of(Next("x", {"s": "a\x00b"})) == "$.s: NUL characters are not allowed"
    waiting = Wait("input", then="x", detail={"due": date(2026, 12, 1)})
    assert error_of(waiting) == "waiting_for.due: date is not a JSON value"


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("how", ["not_json", "raise", COMMIT])
def test_a_real_worker_counts_each_failure(
    how: str, tenant_a: Tenant, reviewer_a: Persona, tmp_path: Path
) -> None:
    env = procs.child_env(HOLDPOINT_GRAPH_MODULES="tests.runtime.failing")
    worker = procs.start(["qcluster"], env, log=tmp_path / "worker.log")
    try:
        run = _start(tenant_a, how)

        def escalated() -> bool:
            sweep_once()  # wakes the retries when their backoff is over
            run.refresh_from_db()
            return run.status == RunStatus.NEEDS_ATTENTION

        procs.wait_for(escalated, timeout=90, every=0.3)
    finally:
        procs.kill(worker)
    _assert_escalated(run, how, reviewer_a)


def test_a_migration_to_a_state_that_is_not_json_half_applies_nothing(tenant_a: Tenant) -> None:
    from datetime import date

    from runtime.graphs import registry
    from runtime.lifecycle import provide_input
    from tests.graphs import evolving

    registry.register(evolving("1"))
    try:
        run = create_run(tenant_a, "evolving", {}, actor="t")
        advance_run(run.run_id, "w1")  # waits for input on version 1
        registry.unregister("evolving", "1")
        registry.register(evolving("2"))
        registry.register_migration("evolving", "1", "2", lambda s: {**s, "since": date.today()})
        provide_input(run, {}, expected_rev=1, actor="t")
        assert advance_run(run.run_id, "w1").outcome == "needs_attention"
    finally:
        for version in ("1", "2"):
            registry.unregister("evolving", version)
        registry.migrations.pop(("evolving", "1"), None)
    run.refresh_from_db()
    assert run.graph_version == "1" and run.checkpoint_rev == 1
    assert "migration from 1 failed: $.since: date is not a JSON value" in run.attention_reason


def test_a_step_past_its_timeout_is_stopped_and_counted(tenant_a: Tenant) -> None:
    """A step that runs past its graph's step_timeout is interrupted (it would sleep 30 s)
    and counted as a failure; the alarm's handler is given back and no timer is left armed
    for whatever the process does next."""
    import signal
    import time

    before = signal.getsignal(signal.SIGALRM)
    run = create_run(tenant_a, "slow", {"sleep": 30}, actor="user:t")
    started = time.monotonic()
    assert advance_run(run.run_id, "w1").outcome == "retrying"
    assert time.monotonic() - started < 20  # interrupted, not slept out
    run.refresh_from_db()
    assert run.last_error.startswith("StepTimeout: step linger exceeded 0.3s")
    assert [f["error"] for f in payloads(run, "step_failed")] == [run.last_error]
    assert signal.getsignal(signal.SIGALRM) is before
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_steps_within_their_timeout_leave_no_alarm_behind(tenant_a: Tenant) -> None:
    """Steps that finish in time complete the run; afterwards no alarm is pending (one
    that fired later would raise StepTimeout into whatever the worker did next)."""
    import signal

    before = signal.getsignal(signal.SIGALRM)
    run = create_run(tenant_a, "slow", {"sleep": 0.01}, actor="user:t")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert signal.getsignal(signal.SIGALRM) is before
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
