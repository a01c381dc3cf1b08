"""The tenant admin names an external run's executor on the run page (issue 16 H1).

`runtime.protocol.name_executor` is the one writer; the run page's form is the tenant admin's
way to call it. These tests check what the admin sees, that the named agent then leases the
run over the protocol while its creator is refused, and that nobody else — a reviewer, a
viewer, another tenant's admin — can name one, nor anyone for a run Holdpoint's workers run.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from audit.models import JournalEntry
from runtime.models import Role, Run, Tenant
from tests.api import fresh_throttle, new_run, post, problem, row_counts, take_lease  # noqa: F401
from tests.conftest import Persona, make_persona
from tests.runtime.helpers import expire_lease

pytestmark = pytest.mark.django_db
FORM = 'action="/runs/{}/executor/"'


def page_of(persona: Persona) -> Client:
    client = Client()
    client.force_login(persona.user)
    return client


def name(client: Client, run_id: str, account: str, **extra: Any) -> Any:
    return client.post(
        reverse("run-executor", args=[run_id]), {"executor_account": account}, **extra
    )


def test_a_tenant_admin_names_another_agent_which_then_leases_while_the_creator_cannot(
    admin_a: Persona, agent_a: Persona
) -> None:
    other = make_persona(agent_a.tenant, "agent-a2", Role.AGENT)
    mine = agent_a.api()
    run_id = new_run(mine)["run_id"]
    fence = take_lease(mine, run_id)
    admin = page_of(admin_a)

    page = admin.get(reverse("run", args=[run_id])).content.decode()
    assert FORM.format(run_id) in page
    assert '<option value="agent-a2">' in page and '"agent-a" selected' in page

    named = name(admin, run_id, "agent-a2", follow=True)
    assert named.status_code == 200
    assert "agent-a2 now executes this run" in named.content.decode()
    assert Run.objects.get(pk=run_id).executor_account == other.user
    entry = JournalEntry.objects.get(stream=f"run:{run_id}", type="executor_named")
    assert entry.actor == "user:ada" and entry.payload["executor_account"] == "agent-a2"

    expire_lease(run_id)
    assert take_lease(other.api(), run_id) == fence + 1
    problem(
        post(mine, f"runs/{run_id}/lease/", {"owner": "x", "ttl_seconds": 60}),
        403,
        "not_permitted",
    )


@pytest.mark.parametrize("role", [Role.REVIEWER, Role.VIEWER])
def test_a_reviewer_or_viewer_sees_no_form_and_is_refused(agent_a: Persona, role: str) -> None:
    make_persona(agent_a.tenant, "agent-a2", Role.AGENT)
    run_id = new_run(agent_a.api())["run_id"]
    person = page_of(make_persona(agent_a.tenant, f"person-{role}", role))
    assert FORM.format(run_id) not in person.get(reverse("run", args=[run_id])).content.decode()

    before = row_counts()
    assert name(person, run_id, "agent-a2").status_code == 403
    assert row_counts() == before
    assert Run.objects.get(pk=run_id).executor_account == agent_a.user


def test_another_tenants_admin_gets_the_404_of_a_missing_run(
    agent_a: Persona, agent_b: Persona, tenant_b: Tenant
) -> None:
    run_id = new_run(agent_a.api())["run_id"]
    intruder = page_of(make_persona(tenant_b, "bea", Role.ADMIN, is_staff=True))

    before = row_counts()
    foreign = name(intruder, run_id, "agent-b")
    missing = name(intruder, "00000000-0000-4000-8000-000000000000", "agent-b")
    assert foreign.status_code == missing.status_code == 404
    assert foreign.content == missing.content
    assert row_counts() == before
    assert Run.objects.get(pk=run_id).executor_account == agent_a.user


def test_an_account_that_is_not_an_agent_of_the_tenant_is_a_400_and_nothing_written(
    admin_a: Persona, agent_a: Persona, agent_b: Persona
) -> None:
    run_id = new_run(agent_a.api())["run_id"]
    admin = page_of(admin_a)
    before = row_counts()
    for account in ("agent-b", "ada", "", "a\x00b", "x" * 5000):
        refused = name(admin, run_id, account)
        assert refused.status_code == 400, account
        assert "not an agent account of this tenant" in refused.content.decode()
    assert row_counts() == before
    assert Run.objects.get(pk=run_id).executor_account == agent_a.user


def test_a_hosted_run_shows_no_form_and_a_post_is_refused(
    admin_a: Persona, agent_a: Persona
) -> None:
    run_id = new_run(agent_a.api(), external=False)["run_id"]
    admin = page_of(admin_a)
    assert FORM.format(run_id) not in admin.get(reverse("run", args=[run_id])).content.decode()

    before = row_counts()
    refused = name(admin, run_id, "agent-a", follow=True)
    said = [str(m) for m in refused.context["messages"]]
    assert any("executed by Holdpoint's workers" in m for m in said), said
    assert row_counts() == before
    assert Run.objects.get(pk=run_id).executor_account is None


def test_a_finished_external_run_gets_no_new_executor(admin_a: Persona, agent_a: Persona) -> None:
    """Nobody executes a finished run: naming one would journal an act with no meaning."""
    from runtime.lifecycle import cancel_run

    make_persona(agent_a.tenant, "agent-a2", Role.AGENT)
    run_id = new_run(agent_a.api())["run_id"]
    cancel_run(Run.objects.get(pk=run_id), "done with it", actor="user:ada")
    admin = page_of(admin_a)

    before = row_counts()
    refused = name(admin, run_id, "agent-a2", follow=True)
    said = [str(m) for m in refused.context["messages"]]
    assert any("nobody executes it any more" in m for m in said), said
    assert row_counts() == before
    assert Run.objects.get(pk=run_id).executor_account == agent_a.user
