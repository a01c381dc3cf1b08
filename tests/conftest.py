"""Personas and helpers shared by every test area (STYLE.md, "Tests")."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser, Group
from hypothesis import settings as hypothesis_settings
from rest_framework.test import APIClient

from runtime.models import Membership, Role, Tenant
from tests.ci_pair import pytest_collection_modifyitems  # noqa: F401  (a hook: CI's pair)
from tests.httpservers import dns, serve  # noqa: F401  (real HTTP servers; a changing DNS)
from tests.httpx_tls import install as install_httpx_tls
from tests.kept_tables import install as install_kept_tables
from tests.mcp_fixture import mcp_upstream  # noqa: F401  (the test MCP upstream)
from tests.orphans import no_orphan_connections  # noqa: F401  (threads close their connections)
from tests.pg_flush import install as install_pg_flush
from tests.pg_guard import pytest_runtest_makereport  # noqa: F401  (a hook: pg-only skips fail)
from tests.sandbox import sandbox_factory, sandbox_pool  # noqa: F401  (fixtures for every area)

User = get_user_model()
install_pg_flush()  # PostgreSQL: truncate only the tables a test left rows in
install_httpx_tls()  # httpx clients share one default TLS context, made once
install_kept_tables()  # a flush keeps the content types and permissions post_migrate remakes

# Property tests: CI (`.ci/run` sets HYPOTHESIS_PROFILE=ci) tries the same examples on every
# run, so main's verdict never depends on which examples a run happened to draw; a developer's
# run draws new ones (the default profile) — that is where a fast path's disagreement with its
# authority turns up — and a failure prints the blob that replays it.
hypothesis_settings.register_profile("ci", derandomize=True, print_blob=True)
hypothesis_settings.register_profile("dev", print_blob=True)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture(scope="session", autouse=True)
def live_readers_closed(django_db_setup: None) -> Iterator[None]:
    """The process's live-event doorbell keeps a PostgreSQL connection per reader thread
    (runtime.live) for as long as the process lives: closed before the test database is
    dropped, which they kept from being dropped (and left on the server)."""
    yield
    from runtime import live

    live.doorbell.close_readers()


@dataclass
class Persona:
    user: AbstractBaseUser
    tenant: Tenant
    role: str
    token: str | None = None

    def api(self) -> APIClient:
        client = APIClient()
        if self.token:
            client.credentials(HTTP_AUTHORIZATION=f"Token {self.token}")
        else:
            client.force_login(self.user)
        return client


def issue_token_for(user: AbstractBaseUser) -> str:
    """A new API token's key for a member (journalled like any issued token)."""
    from runtime.auth import issue_token

    return issue_token(user, actor="test:personas").key


def make_persona(tenant: Tenant, username: str, role: str, **user_fields: Any) -> Persona:
    user = User.objects.create_user(username=username, password="pw-" + username, **user_fields)
    Membership.objects.create(tenant=tenant, user=user, role=role)
    token = issue_token_for(user) if role == Role.AGENT else None
    if role == Role.REVIEWER:
        group, _ = Group.objects.get_or_create(name=f"{tenant.slug}-reviewers")
        user.groups.add(group)
    return Persona(user=user, tenant=tenant, role=role, token=token)


@pytest.fixture
def tenant_a(db: None) -> Tenant:
    return Tenant.objects.create(slug="acme", name="Acme")


@pytest.fixture
def tenant_b(db: None) -> Tenant:
    return Tenant.objects.create(slug="globex", name="Globex")


@pytest.fixture
def reviewer_a(tenant_a: Tenant) -> Persona:
    """May decide hold points in tenant A."""
    return make_persona(tenant_a, "alice", Role.REVIEWER)


@pytest.fixture
def viewer_a(tenant_a: Tenant) -> Persona:
    """May look at tenant A, not decide."""
    return make_persona(tenant_a, "victor", Role.VIEWER)


@pytest.fixture
def admin_a(tenant_a: Tenant) -> Persona:
    """Tenant A's admin: staff, not superuser."""
    from approvals.management.commands.seed_demo import Command

    persona = make_persona(tenant_a, "ada", Role.ADMIN, is_staff=True)
    persona.user.groups.add(Command()._tenant_admin_group())
    return persona


@pytest.fixture
def outsider_b(tenant_b: Tenant) -> Persona:
    """A reviewer of tenant B: must never see or touch tenant A."""
    return make_persona(tenant_b, "bob", Role.REVIEWER)


@pytest.fixture
def agent_a(tenant_a: Tenant) -> Persona:
    return make_persona(tenant_a, "agent-a", Role.AGENT)


@pytest.fixture
def agent_b(tenant_b: Tenant) -> Persona:
    return make_persona(tenant_b, "agent-b", Role.AGENT)


def _db_fixture_of(request: pytest.FixtureRequest) -> str | None:
    marker = request.node.get_closest_marker("django_db")
    if marker is not None and marker.kwargs.get("transaction"):
        return "transactional_db"
    if "transactional_db" in request.fixturenames or "live_server" in request.fixturenames:
        return "transactional_db"
    if marker is not None or "db" in request.fixturenames:
        return "db"
    return None


@pytest.fixture(autouse=True)
def journal_explains_every_run(request: pytest.FixtureRequest) -> Any:
    """After every test: each run's status rebuilt from its journal equals the stored one,
    and each run's chain and checkpoints verify, and no checkpoint outlived its run. Event
    sourcing is checked on every run the suite makes."""
    db_fixture = _db_fixture_of(request)
    if db_fixture is not None:
        request.getfixturevalue(db_fixture)
    yield
    if db_fixture is None or request.node.get_closest_marker("tampers_journal"):
        return
    from audit.journal import run_stream
    from audit.verification import verify_stream
    from runtime.checkverify import orphans, verify_run
    from runtime.events import rebuild_status
    from runtime.models import Run

    for run in Run.objects.only("run_id", "status", "tenant_id", "checkpoint_rev"):
        assert rebuild_status(run.run_id) == run.status, f"journal disagrees for run {run.run_id}"
        assert verify_stream(run_stream(run.run_id)) is None, f"chain broken for run {run.run_id}"
        assert verify_run(run)[1] == [], f"checkpoints of run {run.run_id} do not verify"
    assert orphans() == [], "checkpoints outlived their runs"


@pytest.fixture(autouse=True)
def closed_circuits() -> None:
    """Circuit breakers are per process; each test starts like a fresh worker."""
    from runtime.tools import reset_breakers

    reset_breakers()


@pytest.fixture(autouse=True)
def forgotten_tenant_memos() -> None:
    """What a process remembers per tenant id — the tool version it last found current, a
    tenant's slug for traces, the tools a policy named lately — starts empty in each test,
    as in a fresh worker: ids are reused after a test's rollback, and a memo of the last
    test's tenant made a tracing test count two prepares (the guessed version of
    tickets.create was the last test's, so the prepare started again; CI, SQLite)."""
    from runtime import dispatch, tenancy, tools

    tools._latest.clear()
    tenancy._slugs.clear()
    dispatch._NAMED.clear()


@pytest.fixture(autouse=True)
def unused_rate_limits() -> None:
    """Rate limits (decisions, API tokens) are counted in the default cache, which outlives a
    test's database: ids reused after a rollback would inherit the last test's count."""
    from django.core.cache import cache

    cache.clear()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remove this session's scratch directory (databases, caches) unless it failed; in a
    pytest-xdist worker, hand the isolation matrix's figures to the controller first (the
    controller runs no test, so only it can print them all: `pytest_terminal_summary`)."""
    import json
    import shutil

    from django.conf import settings

    from tests.security import matrix

    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None and matrix.SUMMARY:
        workeroutput["isolation_matrix"] = json.dumps(matrix.SUMMARY, default=str)
    if exitstatus == 0 and settings.VAR_DIR.name.startswith("session-"):
        shutil.rmtree(settings.VAR_DIR, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """The controller's side of the hand-over above (a pytest-xdist hook)."""
    import json

    from tests.security import matrix

    handed = getattr(node, "workeroutput", {}).get("isolation_matrix")
    if handed:
        for section, figures in json.loads(handed).items():
            matrix.record(section, **figures)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The isolation matrix's figures (TEST-MATRIX E1, E2), printed and written to a file.
    Here, not in tests/security/conftest.py: under xdist the controller never loads that."""
    from tests.security import matrix

    path = matrix.write_summary()
    if path is None:
        return
    terminalreporter.section("isolation matrix")
    for line in matrix.summary_lines():
        terminalreporter.write_line(line)
    terminalreporter.write_line(f"written to {path}")
