"""`seed_demo` creates the demo world once and is safe to run again."""

from __future__ import annotations

from io import StringIO
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command

from approvals.notify import deliver
from runtime.models import AgentToken, Membership, Role, Tenant
from tests.approvals.test_pages import raise_request

User = get_user_model()


def _seed() -> str:
    out = StringIO()
    call_command("seed_demo", stdout=out)
    return out.getvalue()


@pytest.mark.django_db
def test_seed_demo_is_idempotent(settings: object) -> None:
    first = _seed()
    assert "demo-reviewer" in first
    counts = (User.objects.count(), Membership.objects.count(), Tenant.objects.count())
    hash_before = User.objects.get(username="demo-reviewer").password

    second = _seed()
    assert "already present; their passwords are unchanged" in second
    assert "demo-reviewer" not in second and "sandbox token" not in second
    assert (User.objects.count(), Membership.objects.count(), Tenant.objects.count()) == counts
    assert User.objects.get(username="demo-reviewer").password == hash_before


@pytest.mark.django_db
def test_a_second_seed_says_it_stored_the_sandbox_token(settings: Any) -> None:
    """`make run` again with HOLDPOINT_SANDBOX_TOKENS newly set: the demo tenants' `tasks`
    credential changes, and the output said "nothing changed"."""
    from runtime.models import ToolCredential

    _seed()
    settings.HOLDPOINT_SANDBOX_TOKENS = ["tt-newly-required"]
    second = _seed()
    assert "Stored the sandbox token" in second and "demo" in second
    stored = ToolCredential.objects.get(tenant__slug="demo", service="tasks")
    assert stored.secret().reveal() == "tt-newly-required"
    assert "sandbox token" not in _seed()  # stored already: nothing to say


@pytest.mark.django_db
def test_seed_demo_roles_and_logins(settings: object, client: object) -> None:
    settings.HOLDPOINT_DEMO_PASSWORD = "demo-pass-123"  # type: ignore[attr-defined]
    _seed()
    roles = {m.user.username: (m.tenant.slug, m.role) for m in Membership.objects.all()}
    assert roles == {
        "demo-admin": ("demo", Role.ADMIN),
        "demo-reviewer": ("demo", Role.REVIEWER),
        "demo-viewer": ("demo", Role.VIEWER),
        "demo-agent": ("demo", Role.AGENT),
        "other-reviewer": ("other", Role.REVIEWER),
        "other-agent": ("other", Role.AGENT),
    }
    # Through the login form: django-axes needs the request to count failures by.
    login = client.post("/login/", {"username": "demo-reviewer", "password": "demo-pass-123"})  # type: ignore[attr-defined]
    assert login.status_code == 302 and login.url == "/inbox/"
    assert User.objects.get(username="demo-admin").is_staff
    assert not User.objects.get(username="demo-admin").is_superuser
    assert not User.objects.get(username="demo-agent").has_usable_password()
    reviewer = User.objects.get(username="demo-reviewer")
    assert reviewer.groups.filter(name="demo-reviewers").exists()
    assert (
        not User.objects.get(username="demo-viewer").groups.filter(name="demo-reviewers").exists()
    )


@pytest.mark.django_db
def test_agent_token_issue_works_for_demo_agents() -> None:
    _seed()
    out = StringIO()
    call_command("agent_token", "issue", "demo-agent", stdout=out)
    key = out.getvalue().splitlines()[-1]
    assert AgentToken.objects.authenticate(key).user.username == "demo-agent"


@pytest.mark.django_db
def test_demo_admin_is_limited_to_demo(client: object) -> None:
    _seed()
    admin = User.objects.get(username="demo-admin")
    client.force_login(admin)  # type: ignore[attr-defined]
    page = client.get("/admin/runtime/membership/")  # type: ignore[attr-defined]
    assert page.status_code == 200
    assert b"demo-reviewer" in page.content and b"other-reviewer" not in page.content


@pytest.mark.django_db
def test_seed_demo_gives_the_demo_tenants_the_trackers_tools_as_their_definitions() -> None:
    from runtime.models import ToolDefinition
    from runtime.tools import get_tool

    call_command("seed_demo", "--tracker-url", "http://127.0.0.1:8799", stdout=StringIO())
    call_command("seed_demo", "--tracker-url", "http://127.0.0.1:8799", stdout=StringIO())
    demo = Tenant.objects.get(slug="demo")
    rows = ToolDefinition.objects.filter(tenant=demo).order_by("name")
    # Imported once: the second run changed nothing. Version 1 of each name is the
    # built-in tool (HOLDPOINT_TASKS_URL is set), so the tenant's own start at 2.
    assert [(r.name, r.version) for r in rows] == [
        ("agent.tasks.create", 2),
        ("tasks.close", 2),
        ("tasks.create", 2),
    ]
    create = get_tool("tasks.create", demo.pk)
    assert not create.builtin and create.version == "2"
    assert rows.get(name="tasks.create").spec["request"]["url"] == "http://127.0.0.1:8799/tasks"
    # A new sandbox port is a new version, not an edit.
    call_command("seed_demo", "--tracker-url", "http://127.0.0.1:8800", stdout=StringIO())
    assert get_tool("tasks.create", demo.pk).version == "3"


@pytest.mark.django_db
def test_demo_people_get_example_com_addresses_and_notifications_reach_them(
    mailoutbox: list[Any],
) -> None:
    """Without addresses no notification was ever sent in `make run` (issue 20): the people
    get one at example.com, the agents none, and a held tasks.create in tenant demo mails
    the two who may decide it."""
    _seed()
    addresses = dict(User.objects.values_list("username", "email"))
    assert addresses == {
        "demo-admin": "demo-admin@example.com",
        "demo-reviewer": "demo-reviewer@example.com",
        "demo-viewer": "demo-viewer@example.com",
        "demo-agent": "",
        "other-reviewer": "other-reviewer@example.com",
        "other-agent": "",
    }
    request = raise_request(Tenant.objects.get(slug="demo"), actor="agent:demo-agent")
    assert deliver("requested", str(request.pk))["emails"] == 2
    assert sorted(m.to[0] for m in mailoutbox) == [
        "demo-admin@example.com",
        "demo-reviewer@example.com",
    ]


@pytest.mark.django_db
def test_a_fresh_demo_leaves_the_doctor_no_write_tool_to_warn_about() -> None:
    """Every write tool of the demo tenants is named by a policy from the start — the one
    its first held action would get (any reviewer of the tenant decides), so the demo holds
    what it held — and `manage.py doctor` on a fresh `make run` says nothing about them."""
    from approvals.models import ApprovalPolicy
    from runtime.health import check_write_policies

    _seed()
    assert check_write_policies()["ok"], check_write_policies()
    made = ApprovalPolicy.objects.filter(
        name__endswith="(write tools wait for reviewers by default)"
    )
    assert {(p.tenant.slug, p.tool, p.any_reviewer) for p in made} == {
        ("demo", "tasks.close", True),
        ("demo", "agent.tasks.create", True),
        ("other", "tasks.create", True),
        ("other", "tasks.close", True),
        ("other", "agent.tasks.create", True),
    }
    _seed()  # again: nothing more
    assert made.count() == 5
