"""/metrics against the database after a scripted scenario, the token, the query budget and
the Grafana dashboard's queries (API.md, "Metrics")."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import time_machine
from django.core.management import CommandError, call_command
from django.db import connection
from django.db.models.functions import Now
from django.test import Client
from django.test.utils import CaptureQueriesContext

from approvals.models import ApprovalRequest, ApprovalStatus
from audit.journal import run_stream
from audit.models import JournalEntry
from runtime.executor import advance_run
from runtime.leases import take_lease
from runtime.lifecycle import create_run
from runtime.models import Action, ActionStatus, Run, RunStatus, Tenant
from runtime.sweeper import sweep_once
from runtime.tools import tool_of  # noqa: F401  (registers the test tools through tests.graphs)
from tests.api import new_run, post
from tests.api import take_lease as take_lease_over_api
from tests.audit.tamper import tampering
from tests.conftest import Persona
from tests.ops.metrics import scrape, value
from tests.runtime.helpers import expire_lease

ROOT = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)


def _scenario(tenant: Tenant) -> dict[str, Run]:
    """Runs in several statuses, an action waiting for approval, one lease takeover."""
    runs = {
        "queued": create_run(tenant, "chain", {"steps": 2}, actor="t"),
        "completed": create_run(tenant, "chain", {"steps": 2}, actor="t"),
        "waiting_input": create_run(tenant, "asker", {}, actor="t"),
        "waiting_approval": create_run(tenant, "proposer", {"title": "x"}, actor="t"),
        "taken_over": create_run(tenant, "chain", {"steps": 2}, actor="t"),
    }
    for name in ("completed", "waiting_input", "waiting_approval"):
        advance_run(runs[name].run_id, "w1")
    take_lease(runs["taken_over"].run_id, "w1", 5)  # w1 dies holding it…
    expire_lease(runs["taken_over"])
    advance_run(runs["taken_over"].run_id, "w2")  # …and w2 takes over and finishes
    return runs


def test_values_match_the_database_after_a_scenario(tenant_a: Tenant) -> None:
    with time_machine.travel(T0, tick=False):
        runs = _scenario(tenant_a)
    # A request's age is the database clock's (it writes created_at): an hour old there,
    # scraped by a process whose clock is a day behind.
    ApprovalRequest.objects.update(created_at=Now() - timedelta(seconds=3600))
    with time_machine.travel(T0 - timedelta(days=1), tick=False):
        samples = scrape()

    for status in RunStatus.values:
        assert (
            value(samples, "holdpoint_runs", status=status)
            == Run.objects.filter(status=status).count()
        ), status
    for status in ActionStatus.values:
        assert (
            value(samples, "holdpoint_actions", status=status)
            == Action.objects.filter(status=status).count()
        ), status
    # …and the database holds what the scenario made.
    assert value(samples, "holdpoint_runs", status="queued") == 1
    assert value(samples, "holdpoint_runs", status="completed") == 2
    assert value(samples, "holdpoint_runs", status="waiting_input") == 1
    assert value(samples, "holdpoint_runs", status="waiting_approval") == 1
    assert value(samples, "holdpoint_actions", status="awaiting_approval") == 1
    assert value(samples, "holdpoint_reconcile_backlog") == 0
    pending = ApprovalRequest.objects.filter(status=ApprovalStatus.PENDING)
    assert value(samples, "holdpoint_approvals_pending") == pending.count() == 1
    assert 3600 <= value(samples, "holdpoint_oldest_pending_approval_seconds") < 3660
    assert value(samples, "holdpoint_lease_takeovers_total") == 1
    assert runs["taken_over"].actions.count() == 0


def test_reconcile_backlog_counts_unknown_and_manual_review(tenant_a: Tenant) -> None:
    run = create_run(tenant_a, "proposer", {"title": "x"}, actor="t")
    advance_run(run.run_id, "w1")
    # Moving data, not driving a tracker: the backlog is a count of these two statuses.
    Action.objects.filter(run=run).update(status=ActionStatus.UNKNOWN)
    assert value(scrape(), "holdpoint_reconcile_backlog") == 1
    Action.objects.filter(run=run).update(status=ActionStatus.MANUAL_REVIEW)
    samples = scrape()
    assert value(samples, "holdpoint_reconcile_backlog") == 1
    assert value(samples, "holdpoint_actions", status="manual_review") == 1


def test_a_scrape_costs_the_same_statements_whatever_the_data(tenant_a: Tenant) -> None:
    def statements() -> int:
        with CaptureQueriesContext(connection) as queries:
            scrape()
        return len(queries)

    empty = statements()
    _scenario(tenant_a)
    for _ in range(5):
        advance_run(create_run(tenant_a, "chain", {"steps": 2}, actor="t").run_id, "w1")
    assert statements() == empty == 4


def test_refused_without_the_token_when_one_is_set(settings: Any, db: None) -> None:
    settings.HOLDPOINT_METRICS_TOKEN = "s3cret-token"
    client = Client()
    for headers in (
        {},
        {"HTTP_AUTHORIZATION": "Bearer wrong"},
        {"HTTP_AUTHORIZATION": "Token s3cret-token"},
    ):
        refused = client.get("/metrics", **headers)
        assert refused.status_code == 401
        assert refused.content == b""
        assert refused["WWW-Authenticate"].startswith("Bearer")
    samples = scrape(client, HTTP_AUTHORIZATION="Bearer s3cret-token")
    assert ("holdpoint_approvals_pending", ()) in samples


def _exported(samples: dict[tuple[str, Any], float]) -> set[str]:
    names = {name for name, _ in samples}
    return names | {re.sub(r"_(bucket|count|sum|total|created)$", "", name) for name in names}


def test_every_metric_the_dashboard_queries_is_exported(db: None) -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "holdpoint.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    queried = {name for expr in exprs for name in re.findall(r"\bholdpoint_[a-z_]+", expr)}
    assert len(queried) >= 8
    # Both histograms are in every scrape once any process observed one (multiprocess files).
    from runtime import metrics

    metrics.observe_step(metrics.clock())
    metrics.observe_action("tasks.create", metrics.clock())
    assert queried <= _exported(scrape())


def test_the_takeover_count_reads_its_partial_index(db: None) -> None:
    """The count's predicate is the one migration 0022 indexed: a scrape never scans the
    journal (which grows by every step of every run) to count the few takeovers."""
    from runtime.metrics import takeovers_sql

    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET LOCAL enable_seqscan = off")
            cursor.execute("EXPLAIN " + takeovers_sql("postgresql"), ["lease_taken"])
        else:
            cursor.execute("EXPLAIN QUERY PLAN " + takeovers_sql("sqlite"), ["lease_taken"])
        plan = " ".join(str(row) for row in cursor.fetchall())
    assert "runtime_journal_takeovers" in plan


@pytest.mark.tampers_journal
def test_the_takeover_counter_never_goes_down_across_a_purge(tenant_a: Tenant) -> None:
    """The count was read from the journal's takeover entries, whose payloads the retention
    purge replaces by digests: after a purge the counter went down (Prometheus reads that as
    a reset, and `increase()` over it is wrong). The purge now keeps what it redacts
    counted — and not a second time what it could not redact (a run it kept)."""
    Tenant.objects.filter(pk=tenant_a.pk).update(retention_days=30)
    taken = [_taken_over(tenant_a) for _ in range(4)]
    before = value(scrape(), "holdpoint_lease_takeovers_total")
    assert before == 4
    Run.objects.filter(pk__in=[r.pk for r in taken]).update(
        updated_at=datetime.now(UTC) - timedelta(days=31)
    )
    kept = JournalEntry.objects.get(stream=run_stream(taken[0].run_id), seq=1)
    with tampering() as cursor:  # a payload no writer stores: the purge keeps this run
        cursor.execute(
            "UPDATE audit_journalentry SET payload = %s WHERE id = %s",
            ['{"n": 1152921504606846976}', kept.pk],
        )
    with pytest.raises(CommandError, match="1 due run"):
        call_command("purge", "--batch-size", "2", stdout=StringIO())
    assert Run.objects.filter(pk__in=[r.pk for r in taken]).count() == 1
    assert value(scrape(), "holdpoint_lease_takeovers_total") == before
    _taken_over(tenant_a)
    assert value(scrape(), "holdpoint_lease_takeovers_total") == before + 1


def _taken_over(tenant: Tenant) -> Run:
    run = create_run(tenant, "chain", {"steps": 2}, actor="t")
    take_lease(run.run_id, "w1", 5)
    expire_lease(run)
    advance_run(run.run_id, "w2")
    return run


@pytest.mark.parametrize(("owner", "counted"), [("agent-2", 1), ("agent-1", 0)])
def test_a_lease_after_the_sweeper_declared_its_executor_lost_is_a_takeover(
    agent_a: Persona, settings: Any, owner: str, counted: int
) -> None:
    """The sweeper clears a lost executor's lease (`executor_lost`), so the next lease saw
    no previous owner and was never counted, though another executor took the run whose
    holder's lease had expired. The same executor coming back takes nothing from anyone."""
    settings.HOLDPOINT_EXECUTOR_GRACE = 10
    client = agent_a.api()
    run_id = new_run(client)["run_id"]
    take_lease_over_api(client, run_id, owner="agent-1", ttl=5)
    Run.objects.filter(pk=run_id).update(lease_expires_at=Now() - timedelta(seconds=11))
    sweep_once(ring=lambda run_id: None)
    assert Run.objects.get(pk=run_id).attention_reason == "executor_lost"
    before = value(scrape(), "holdpoint_lease_takeovers_total")

    take_lease_over_api(client, run_id, owner=owner)

    assert value(scrape(), "holdpoint_lease_takeovers_total") == before + counted


def test_a_client_tools_action_is_timed_from_its_sent_mark_to_its_reported_outcome(
    agent_a: Persona,
) -> None:
    """Hosted tools' requests were timed around the call; a `client` tool's request is made
    by the external executor, and its actions never reached the histogram. Timed now by the
    database's clock, from the dispatch (`sent`) to the outcome that settles it — once: a
    repeated report is not a second request."""
    client = agent_a.api()
    tool = "agent.tasks.create"
    run_id = new_run(client)["run_id"]
    fence = take_lease_over_api(client, run_id)
    before = scrape()
    for verdict, fields in (("confirmed", {"external_id": "T-1"}), ("failed", {})):
        action = post(
            client,
            f"runs/{run_id}/actions/",
            {"fence": fence, "tool": tool, "params": {"title": verdict}, "reason": "r"},
        ).json()
        post(client, f"actions/{action['action_id']}/dispatch/", {"fence": fence})
        # The executor's request took 3 s (the sent mark moved back: data, not a clock).
        Action.objects.filter(pk=action["action_id"]).update(sent_at=Now() - timedelta(seconds=3))
        body = {"fence": fence, "outcome": verdict, **fields}
        answer = post(client, f"actions/{action['action_id']}/outcome/", body)
        assert answer.status_code == 200, answer.content
        # A repeated report (a retry after a lost reply) records nothing, times nothing.
        post(client, f"actions/{action['action_id']}/outcome/", body)
    after = scrape()

    def grown(name: str) -> float:
        return value(after, name, tool=tool) - value(before, name, tool=tool)

    assert grown("holdpoint_action_duration_seconds_count") == 2
    assert 6 <= grown("holdpoint_action_duration_seconds_sum") < 60
    assert value(after, "holdpoint_action_duration_seconds_bucket", tool=tool, le="1.0") == value(
        before, "holdpoint_action_duration_seconds_bucket", tool=tool, le="1.0"
    )
