"""The gateway SIGKILLed mid-call (issue 19): the web process (uvicorn, config.asgi) is armed
with a fault point (runtime/faults.py) and dies there with its whole process group, as a
machine crash would; a new one starts on the same address and the MCP client carries on
its session (the session id is the run's id, adopted by the new process). The oracle for
effects is the upstream's own record of the calls that reached it."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from approvals.models import ApprovalPolicy, ApprovalRequest
from runtime import mcpimport, tooldefs
from runtime.models import Action, ActionStatus, McpServer, Run, RunStatus, Tenant
from tests import procs
from tests.conftest import Persona
from tests.gateway.helpers import Background, Progress, text
from tests.mcp_fixture import Upstream

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
S = ActionStatus
CREATE = "helpdesk.tickets_create"
OPEN = "helpdesk.tickets_open"


class Gateway:
    """The web server on one port, started and restarted (with or without fault points)."""

    def __init__(self, log_dir: Path) -> None:
        self.port: int | None = None  # the first start's, kept by every restart
        self.base = ""
        self.log_dir = log_dir
        self.proc: Any = None

    def start(self, faults: str = "") -> None:
        extra = {"HOLDPOINT_FAULTS": faults} if faults else {}

        def env(port: int) -> dict[str, str]:
            return procs.child_env(
                HOLDPOINT_BASE_URL=f"http://127.0.0.1:{port}",
                HOLDPOINT_MCP_WAIT_SECONDS="60",
                **extra,
            )

        log = self.log_dir / f"web-{faults or 'clean'}.log"
        self.proc, self.base = procs.start_web(env, log, port=self.port)
        self.port = int(self.base.rsplit(":", 1)[1])

    def died_at(self, point: str) -> None:
        """The process is gone, killed by the fault point (not by the test)."""
        self.proc.wait(timeout=60)
        log = (self.log_dir / f"web-{point}.log").read_text("utf-8", "replace")
        assert f"fault point reached: {point}" in log, log[-2000:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            procs.kill(self.proc)

    def endpoint(self, tenant: Tenant) -> str:
        assert self.base, "the gateway's address is known once it has started"
        return f"{self.base}/mcp/{tenant.slug}/"


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    server = Gateway(tmp_path)
    try:
        yield server
    finally:
        server.stop()


def _call(name: str, arguments: dict[str, Any]) -> Callable[[Any], Any]:
    async def work(client: Any) -> Any:
        return await client.call_tool(name, arguments, progress_callback=Progress())

    return work


def _carry_on(url: str, key: str, run_id: str, name: str, arguments: dict[str, Any]) -> Any:
    """The same call again in the same session, from a client that kept its session id."""
    return Background(url, key, _call(name, arguments), session_id=run_id).result()


def _lost(url: str, key: str, name: str, arguments: dict[str, Any]) -> BaseException:
    """A call whose answer never comes: the server died under it."""
    try:
        Background(url, key, _call(name, arguments)).result()
    except BaseException as exc:  # noqa: BLE001 (what the client saw: a broken connection)
        return exc
    raise AssertionError("the call was answered although the gateway was killed")


def _session_of(tenant: Tenant) -> Run:
    return Run.objects.get(tenant=tenant, graph="mcp-session")


def _plain(tenant: Tenant, upstream: Upstream) -> None:
    """The upstream's tools imported as they are (no dedup): a lost answer goes to a person.
    A policy lets the create go without a reviewer (the crash is what is under test)."""
    McpServer.objects.create(tenant=tenant, name="helpdesk", url=upstream.url, timeout_seconds=2)
    mcpimport.import_tools(McpServer.objects.get(tenant=tenant), "user:admin")
    ApprovalPolicy.objects.create(tenant=tenant, name="creates go", tool=CREATE, required=False)


def _killed_at(
    gateway: Gateway, point: str, tenant: Tenant, agent: Persona, tool: str
) -> tuple[Action, Callable[[], Any]]:
    """A call made while the gateway is armed with `point`; the process dies there, a new
    one starts. The action as the dead process left it, and the same call again (in the same
    session, by a client that kept its id)."""
    title = f"Printer {uuid.uuid4().hex[:8]} on fire"
    gateway.start(faults=point)
    url, key = gateway.endpoint(tenant), str(agent.token)
    _lost(url, key, tool, {"title": title})
    gateway.died_at(point)
    action = Action.objects.get(tenant=tenant, params__contains=title)
    gateway.start()
    session = str(_session_of(tenant).run_id)
    return action, lambda: _carry_on(url, key, session, tool, {"title": title})


def test_killed_after_the_outcome_was_recorded_the_same_call_returns_it_and_acts_once(
    gateway: Gateway,
    mcp_upstream: Callable[..., Upstream],
    tenant_a: Tenant,
    agent_a: Persona,
) -> None:
    upstream = mcp_upstream()
    _plain(tenant_a, upstream)
    action, again = _killed_at(gateway, "after_confirm", tenant_a, agent_a, CREATE)
    assert action.status == S.CONFIRMED  # recorded, but the client never got it
    assert len(upstream.calls("tickets_create")) == 1

    answer = again()
    assert not answer.is_error, text(answer)
    title = json.loads(action.params)["title"]
    assert answer.structured_content == {"id": action.external_id, "title": title}
    assert len(upstream.calls("tickets_create")) == 1  # the answer came from the ledger
    assert Action.objects.filter(tenant=tenant_a).count() == 1


def test_killed_after_the_upstream_answered_a_tool_without_lookup_goes_to_a_person(
    gateway: Gateway,
    mcp_upstream: Callable[..., Upstream],
    tenant_a: Tenant,
    agent_a: Persona,
) -> None:
    upstream = mcp_upstream()
    _plain(tenant_a, upstream)
    action, again = _killed_at(gateway, "after_tool_response", tenant_a, agent_a, CREATE)
    assert action.status == S.SENT  # the effect happened; nothing says so
    assert len(upstream.calls("tickets_create")) == 1

    # The dead process's lease runs out (tool timeout + margin); the call waits that long
    # (progress notifications) and then the takeover hands the action to a person.
    answer = again()
    assert answer.is_error and text(answer).startswith("NEEDS A PERSON"), text(answer)
    assert answer.meta["holdpoint/reconcile_url"].endswith(f"/reconcile/{action.pk}/")
    action.refresh_from_db()
    assert action.status == S.MANUAL_REVIEW
    assert len(upstream.calls("tickets_create")) == 1  # never sent again
    run = _session_of(tenant_a)
    assert run.status == RunStatus.NEEDS_RECONCILIATION  # open for the person, on the inbox
    assert not ApprovalRequest.objects.filter(action=action).exists()


def test_killed_after_the_upstream_answered_a_lookup_tool_finds_the_effect_by_its_key(
    gateway: Gateway,
    mcp_upstream: Callable[..., Upstream],
    tenant_a: Tenant,
    agent_a: Persona,
) -> None:
    upstream = mcp_upstream(keyed=True)
    McpServer.objects.create(tenant=tenant_a, name="helpdesk", url=upstream.url, timeout_seconds=2)
    tooldefs.define(
        tenant_a,
        {
            "name": OPEN,
            "effect": "write",
            "schema": {
                "type": "object",
                "properties": {"title": {"type": "string"}},
                "required": ["title"],
            },
            "executor": "mcp",
            "mcp": {"server": "helpdesk", "tool": "tickets_open", "key_argument": "request_id"},
            "dedup": {"mode": "lookup"},
            "lookup": {
                "tool": "tickets_find",
                "arguments": {"request_id": "{idempotency_key}"},
                "found": "$.id",
            },
            "timeout_seconds": 1.5,
        },
        "user:admin",
    )
    ApprovalPolicy.objects.create(tenant=tenant_a, name="opens go", tool=OPEN, required=False)
    action, again = _killed_at(gateway, "after_tool_response", tenant_a, agent_a, OPEN)
    assert action.status == S.SENT
    answer = again()
    action.refresh_from_db()
    assert not answer.is_error, (text(answer), action.last_error)
    assert action.status == S.CONFIRMED and action.external_id == "T-1"
    opened = upstream.calls("tickets_open")
    # Found by asking the lookup tool with the gateway's own key, not by sending again.
    assert [c["arguments"]["request_id"] for c in opened] == [action.idempotency_key]
    assert action.idempotency_key.startswith("mcp:")
