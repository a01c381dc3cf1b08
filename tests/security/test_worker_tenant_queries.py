"""Every SQL statement a worker runs on tenant tables while advancing a run carries that run's
tenant (issue 9, defence in depth behind invariant 9).

A worker is rung with a bare run id. It learns the tenant from the run row and from then on
names it in every statement: conditions (`tenant_id = A`) and inserted rows (tenant_id A).
A wrong id — a bug, a corrupted queue message — then finds nothing instead of another
tenant's row. The hook wraps the database connection (`connection.execute_wrapper`) while
runs of tenant A advance — a plain graph with recorded calls, an action through the ledger
against the real sandbox service (including a lost reply and its reconciliation), and an
approval wait — with tenant B holding runs, actions, a policy and a pending approval of the
same tool, and checks each statement's SQL and parameters.

**Tenant tables**: the tables of every model with a `tenant_id` column (runs, checkpoints,
artifacts, recorded calls, actions, the journal and its stream heads, approval policies and
requests, memberships, … — derived from the models, so a new one is covered at once), and
the tables reached only through such a row, which must name the tenant of that row in a
join: approval votes (through their request) and the policy permission grants (through
their policy). Tenants themselves (`runtime_tenant`) are not a tenant table: they are read
only joined to a tenant-scoped row.

**The one exemption**: a read of `runtime_run` whose only condition is the primary key of
the run being advanced — how the worker learns the tenant from the id it was rung with. A
random 128-bit id of the run itself cannot select another tenant's row. On PostgreSQL that
read also carries the run's stream head (runtime.leases, the lease in two round trips): a
subquery by the run's own stream name, tied to the tenant of the run row it reads
(`"tenant_id" = "runtime_run"."tenant_id"`) — no other tenant's head can come back.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.apps import apps
from django.contrib.auth.models import Group
from django.db import connection

from approvals.decisions import decide
from approvals.models import ApprovalPolicy, ApprovalRequest
from approvals.policies import grant
from runtime.executor import advance_run
from runtime.leases import heartbeat, release, take_lease
from runtime.lifecycle import create_run
from runtime.models import Action, ActionStatus, Role, Run, RunStatus, Tenant
from tests.conftest import make_persona
from tests.sandbox import Sandbox

pytestmark = pytest.mark.django_db(transaction=True)

# Ids no other number in these statements is likely to equal (a fence, a rev, a seq).
A_ID, B_ID = 910_001, 920_002
GOAL = {
    "old_spec": "shop-v1",
    "new_spec": "shop-v2",
    "scope": ["/orders", "/users"],
    "create_review_task": True,
}
# Reached only through a tenant-scoped row, whose tenant the statement must name.
THROUGH_PARENT = {
    "approvals_approvalvote",
    "approvals_policygrouppermission",
    "approvals_policyuserpermission",
}


def tenant_tables() -> set[str]:
    return {
        model._meta.db_table
        for model in apps.get_models()
        if any(f.attname == "tenant_id" for f in model._meta.concrete_fields)
    } | THROUGH_PARENT


_TABLE = re.compile(r'(?:FROM|JOIN|INTO|UPDATE)\s+"?(\w+)"?', re.IGNORECASE)
# `tenant_id = %s`, `tenant_id IN (%s, …)`, and `(tenant_id + 0) = %s` / `+ %s) = %s`: the
# form that names the tenant beside a more selective key (fastsql.statements.tenant_check).
_CONDITION = re.compile(
    r'tenant_id"?(?P<plus>\s*\+\s*(?:0|%s)\s*\))?\s*(?:=\s*%s|IN\s*\(((?:%s,?\s*)+)\))',
    re.IGNORECASE,
)
_INSERT = re.compile(r'INSERT\s+(?:OR\s+\w+\s+)?INTO\s+"?(\w+)"?\s*\(([^)]*)\)', re.IGNORECASE)


_VALUES_END = re.compile(r"\bRETURNING\b|\bON CONFLICT\b", re.IGNORECASE)
# A stream head read along with its run (runtime.leases): by its stream, tied to the run row.
_OWN_HEAD = re.compile(
    r'\(SELECT "\w+" FROM "audit_streamhead" WHERE "stream" = %s'
    r' AND "tenant_id" = "runtime_run"\."tenant_id" LIMIT 1\)'
)


def _flat(values: Any) -> list[Any]:
    if isinstance(values, list | tuple):
        return [v for value in values for v in _flat(value)]
    return [values]


def tenant_bindings(sql: str, params: list[Any]) -> list[Any]:
    """Every value the statement binds to a tenant_id: in a condition, or as an inserted
    row's tenant_id (including PostgreSQL's array-per-column bulk insert)."""
    bound: list[Any] = []
    for match in _CONDITION.finditer(sql):
        first = sql[: match.start()].count("%s")
        count = match.group(0).count("%s")
        skip = (match.group("plus") or "").count("%s")  # the 0 added, not the tenant
        bound += _flat(params[first + skip : first + count])
    for insert in _INSERT.finditer(sql):  # one statement may insert into several tables
        columns = [c.strip().strip('"') for c in insert.group(2).split(",")]
        if "tenant_id" not in columns:
            continue
        position, width = columns.index("tenant_id"), len(columns)
        first = sql[: insert.end()].count("%s")
        values_end = _VALUES_END.search(sql, insert.end())
        count = sql[insert.end() : values_end.start() if values_end else len(sql)].count("%s")
        values = params[first : first + count]
        bound += _flat([values[r * width + position] for r in range(max(1, count // width))])
    return bound


@dataclass
class Capture:
    run_ids: set[str] = field(default_factory=set)
    statements: list[tuple[str, list[Any]]] = field(default_factory=list)

    def __call__(self, execute: Callable[..., Any], sql: str, params: Any, many: bool, ctx: Any):
        for one in params if many else [params]:
            self.statements.append((sql, list(one or [])))
        return execute(sql, params, many, ctx)

    def violations(self) -> list[str]:
        tables = tenant_tables()
        found = []
        for sql, params in self.statements:
            touched = {t for t in _TABLE.findall(sql) if t in tables}
            if not touched or self.discovers_tenant(sql, params):
                continue
            bound = tenant_bindings(sql, params)
            if not bound or any(b != A_ID for b in bound) or B_ID in _flat(params):
                found.append(f"{sorted(touched)} bound {bound}: {sql[:240]} {params[:8]}")
        return found

    def discovers_tenant(self, sql: str, params: list[Any]) -> bool:
        """The exemption: a read of runtime_run by the advanced run's primary key alone —
        with, at most, its own stream's head read along, tied to the run row's tenant."""
        heads = _OWN_HEAD.findall(sql)
        rest = _OWN_HEAD.sub("", sql)
        where = rest.upper().split(" WHERE ", 1)
        if not (
            rest.lstrip().upper().startswith("SELECT")
            and set(_TABLE.findall(rest)) == {"runtime_run"}
            and len(where) == 2
            and where[1].count("%S") == 1
            and '"RUN_ID" = %S' in where[1]
            and params
            and str(params[-1]).replace("-", "") in self.run_ids
        ):
            return False
        run_id = str(params[-1]).replace("-", "")
        streams = [p for p in params[:-1] if isinstance(p, str)]  # the clock's are not
        return len(streams) == len(heads) and all(
            s.startswith("run:") and s[4:].replace("-", "") == run_id for s in streams
        )

    def touching(self) -> int:
        tables = tenant_tables()
        return sum(1 for sql, _ in self.statements if set(_TABLE.findall(sql)) & tables)


@contextmanager
def worker_queries(*runs: Run) -> Iterator[Capture]:
    capture = Capture(run_ids={r.run_id.hex for r in runs})
    with connection.execute_wrapper(capture):
        yield capture


@pytest.fixture
def tenants(db: None) -> tuple[Tenant, Tenant]:
    return (
        Tenant.objects.create(pk=A_ID, slug="qa-a", name="Tenant A"),
        Tenant.objects.create(pk=B_ID, slug="qa-b", name="Tenant B"),
    )


def _policy(tenant: Tenant) -> ApprovalPolicy:
    reviewer = make_persona(tenant, f"rev-{tenant.slug}", Role.REVIEWER)
    policy = ApprovalPolicy.objects.create(tenant=tenant, name="hold tasks", tool="tasks.create")
    grant(policy, Group.objects.get(name=f"{tenant.slug}-reviewers"))
    policy.reviewer = reviewer  # type: ignore[attr-defined]
    return policy


@pytest.fixture
def busy_b(tenants: tuple[Tenant, Tenant], sandbox_factory: Callable[[str], Sandbox]) -> Sandbox:
    """Tenant B has runs in every shape A's runs will take, and a pending approval."""
    box = sandbox_factory("key")
    _, b = tenants
    _policy(b)
    for graph, goal in (("chain", {"steps": 2}), ("api-review", GOAL)):
        advance_run(create_run(b, graph, goal, actor="agent:b").run_id, "wb")
    assert ApprovalRequest.objects.filter(tenant=b, status="pending").exists()
    return box


def _assert_clean(capture: Capture, at_least: int) -> None:
    assert capture.touching() >= at_least  # the hook saw the worker's statements
    problems = capture.violations()
    assert not problems, "statements without tenant A's id:\n" + "\n".join(problems)


def test_a_plain_graph_names_its_tenant_in_every_statement(
    tenants: tuple[Tenant, Tenant], busy_b: Sandbox
) -> None:
    a, _ = tenants
    run = create_run(a, "chain", {"steps": 3}, actor="agent:a")
    with worker_queries(run) as capture:
        result = advance_run(run.run_id, "wa")
    assert result.outcome == "completed"
    _assert_clean(capture, at_least=10)


def test_an_action_through_the_ledger_names_its_tenant_in_every_statement(
    tenants: tuple[Tenant, Tenant], busy_b: Sandbox
) -> None:
    a, _ = tenants
    run = create_run(a, "api-review", GOAL, actor="agent:a")
    busy_b.faults(drop_after=1)  # the first create applies, its reply is lost: reconcile
    with worker_queries(run) as capture:
        result = advance_run(run.run_id, "wa")
    assert result.outcome == "completed", result
    action = Action.objects.get(run=run)
    assert action.status == ActionStatus.CONFIRMED
    assert len(busy_b.tasks(action.idempotency_key)) == 1
    _assert_clean(capture, at_least=15)


def test_an_approval_wait_names_its_tenant_in_every_statement(
    tenants: tuple[Tenant, Tenant], busy_b: Sandbox
) -> None:
    a, _ = tenants
    policy = _policy(a)
    run = create_run(a, "api-review", GOAL, actor="agent:a")
    with worker_queries(run) as parking:
        assert advance_run(run.run_id, "wa").outcome == "waiting"
    request = ApprovalRequest.objects.get(run=run)
    decide(request.pk, policy.reviewer.user, "approve", request.action_hash)  # a web request
    with worker_queries(run) as resuming:
        assert advance_run(run.run_id, "wa").outcome == "completed"
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED
    _assert_clean(parking, at_least=10)
    _assert_clean(resuming, at_least=10)


def test_heartbeat_and_release_name_the_tenant(
    tenants: tuple[Tenant, Tenant], busy_b: Sandbox
) -> None:
    a, _ = tenants
    run = create_run(a, "chain", {"steps": 1}, actor="agent:a")
    with worker_queries(run) as capture:
        lease = take_lease(run.run_id, "wa", ttl=30)
        heartbeat(lease)
        release(lease, requeue=False)
    _assert_clean(capture, at_least=4)


def test_the_hook_catches_a_statement_without_the_tenant(tenants: tuple[Tenant, Tenant]) -> None:
    """The check can fail: a query that would read every tenant's runs is reported."""
    a, b = tenants
    run = create_run(a, "chain", {"steps": 1}, actor="agent:a")
    with worker_queries(run) as capture:
        Run.objects.filter(status=RunStatus.QUEUED).count()
        Run.objects.filter(pk=run.pk, tenant_id=b.pk).exists()
    assert len(capture.violations()) == 2
