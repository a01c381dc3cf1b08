"""The chaos soak, small: real workers killed at random and named points (TEST-MATRIX A2).

The test process is the driver, as `manage.py chaos` is; the workers and the sandbox are
real processes on the test database. The accounting is checked on its own first, so that a
green soak means "nothing happened", not "the checker cannot see".
"""

from __future__ import annotations

from pathlib import Path

import pytest
from django.core.management import call_command, get_commands
from django.core.management.base import CommandError

from chaos.accounting import ChaosReport, table, tally
from chaos.config import ChaosConfig
from chaos.driver import run_chaos
from runtime.models import Run, RunStatus
from tests import procs

KEY = "run-1:1:propose_task:1"


def _report() -> ChaosReport:
    return ChaosReport(runs=3, mode="key", workers=2, seed=1, kill_every=2)


def test_the_accounting_sees_duplicates_false_completions_and_lost_runs() -> None:
    runs = [
        {"run_id": "run-1", "status": RunStatus.COMPLETED, "fence": 3},
        {"run_id": "run-2", "status": RunStatus.COMPLETED, "fence": 1},
        {"run_id": "run-3", "status": RunStatus.RUNNING, "fence": 7},
    ]
    actions = [
        {"run_id": "run-1", "idempotency_key": KEY, "status": "confirmed", "external_id": "t1"},
        # Confirmed, but the service has no task under this key: a false completion, and
        # its run completed without its task: a second one.
        {"run_id": "run-2", "idempotency_key": "k2", "status": "confirmed", "external_id": "t9"},
        {"run_id": "run-3", "idempotency_key": "k3", "status": "sent", "external_id": ""},
    ]
    tasks = [
        {"id": "t1", "idempotency_key": KEY, "run_id": "run-1"},
        {"id": "t2", "idempotency_key": KEY, "run_id": "run-1"},
        {"id": "t3", "idempotency_key": "other", "run_id": "run-3"},
        {"id": "t4", "idempotency_key": "someone-else", "run_id": "not-ours"},
    ]
    report = tally(_report(), runs, actions, tasks)
    assert report.duplicates == 1
    assert (report.false_confirmations, report.false_run_completions) == (1, 1)
    assert report.false_completions == 2
    assert report.lost == 1 and report.stuck == 1 and report.completed == 2
    assert report.unexpected_tasks == 1
    assert (report.tasks_created, report.tasks_expected, report.tasks_in_service) == (3, 3, 4)
    assert (report.max_fence, report.max_fence_run) == (7, "run-3")
    assert not report.ok
    assert {p["kind"] for p in report.problems} == {
        "duplicate",
        "confirmed_without_task",
        "completed_without_task",
        "lost",
        "unexpected_task",
    }


def test_the_command_is_found_and_checks_its_options_before_starting_anything() -> None:
    """`manage.py chaos` comes from the chaos app; a bad option stops it before any process."""
    assert get_commands()["chaos"] == "chaos"
    with pytest.raises(CommandError, match="runs and workers must be at least 1"):
        call_command("chaos", "--runs", "0", "--kill-every", "1")
    with pytest.raises(CommandError, match="kill_every must be positive"):
        call_command("chaos", "--runs", "1", "--kill-every", "0")


def test_a_clean_tally_is_ok() -> None:
    runs = [{"run_id": "run-1", "status": RunStatus.COMPLETED, "fence": 2}]
    actions = [
        {"run_id": "run-1", "idempotency_key": KEY, "status": "confirmed", "external_id": "t1"}
    ]
    tasks = [{"id": "t1", "idempotency_key": KEY, "run_id": "run-1"}]
    report = tally(_report(), runs, actions, tasks)
    assert report.ok and report.duplicates == report.false_completions == report.lost == 0
    assert "result: OK" in table(report)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_chaos_soak_keeps_every_invariant(tmp_path: Path) -> None:
    """Four runs started over 8 s, a kill every ~2 s, replies delayed 1 s: kills land in the
    middle of runs (the sent window included), not between them. About 20-30 s."""
    config = ChaosConfig(
        runs=4,
        kill_every=2,
        mode="key",
        workers=2,
        tenant="chaos",
        seed=20261129,
        timeout=120,
        rate=0.5,
        service_delay=1.0,
        env=procs.child_env,
        log_dir=tmp_path / "chaos",
    )
    report = run_chaos(config)
    summary = table(report)

    assert not report.timed_out, summary
    assert report.kills_total > 0, summary
    assert report.duplicates == 0, summary
    assert report.false_completions == 0, summary
    assert report.lost == 0, summary
    assert report.completed == 4 and report.tasks_created == 4, summary
    assert Run.objects.filter(status=RunStatus.COMPLETED).count() == 4
    assert (tmp_path / "chaos" / "events.jsonl").exists()
