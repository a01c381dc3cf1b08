"""The graph example in the README runs as written (issue 15: it called a method that does
not exist): taken from the README itself, registered, run by the executor against the real
sandbox tracker — once straight through, once held by a policy and approved."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from approvals.decisions import decide
from approvals.models import ApprovalRequest
from runtime.executor import advance_run
from runtime.graphs import registry
from runtime.lifecycle import create_run
from runtime.models import Action, ActionStatus, Run, RunStatus, Tenant
from tests.api import grant_policy
from tests.sandbox import Sandbox

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_graph_source() -> str:
    section = README.read_text().split("## Runs, graphs and workers", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the README's graph example is gone"
    return match.group(1)


@pytest.fixture
def triage() -> Iterator[None]:
    exec(compile(readme_graph_source(), str(README), "exec"), {"__name__": "readme_triage"})
    yield
    registry.unregister("triage", "1")


def test_the_readme_graph_files_one_task(
    triage: None, tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    box = sandbox_factory("key")
    run = create_run(tenant_a, "triage", {"url": box.url + "/tasks"}, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "completed"

    run = Run.objects.get(pk=run.run_id)
    (task,) = box.tasks()
    assert task["title"].startswith("Triage: ")
    action = Action.objects.get(run=run)
    assert action.status == ActionStatus.CONFIRMED and action.external_id == task["id"]


def test_the_readme_graph_waits_for_a_reviewer_when_a_policy_holds_it(
    triage: None, tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox], reviewer_a: Any
) -> None:
    box = sandbox_factory("key")
    grant_policy(tenant_a, tool="tasks.create")
    run = create_run(tenant_a, "triage", {"url": box.url + "/tasks"}, actor="t")
    advance_run(run.run_id, "w1")
    assert Run.objects.get(pk=run.run_id).status == RunStatus.WAITING_APPROVAL
    assert box.tasks() == []

    request = ApprovalRequest.objects.get(action__run_id=run.run_id)
    decide(request.id, reviewer_a.user, "approve", request.action_hash, reason="ok")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert len(box.tasks()) == 1
