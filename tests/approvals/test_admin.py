"""Hold points in Django admin: a tenant admin sees and grants only within their tenant."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import Group
from django.test import Client, override_settings
from django.utils.html import escape

from approvals.models import ApprovalPolicy, ApprovalRequest, TenantWebhook, WebhookDelivery
from approvals.policies import may_decide
from audit.models import JournalEntry
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Membership, Role, Tenant
from tests.approvals.conftest import GOAL
from tests.conftest import Persona

POLICIES = "/admin/approvals/approvalpolicy/"
REQUESTS = "/admin/approvals/approvalrequest/"
WEBHOOKS = "/admin/approvals/tenantwebhook/"
DELIVERIES = "/admin/approvals/webhookdelivery/"


def _policy_form(policy: ApprovalPolicy, **overrides: Any) -> dict[str, Any]:
    """The change form as the browser posts it (tenant is read-only there)."""
    data: dict[str, Any] = {
        "name": policy.name,
        "tool": policy.tool,
        "condition": "",
        "priority": policy.priority,
        "active": "on",
        "required": "on",
        "quorum": policy.quorum,
        "separation_of_duties": "on",
        "expiry_seconds": policy.expiry_seconds,
        "on_expiry": policy.on_expiry,
        "remind_before_seconds": policy.remind_before_seconds,
        "escalate_after_seconds": "",
        "escalation_group": "",
        "decider_groups": [],
    }
    data.update(overrides)
    return data


def _errors(response: Any) -> dict[str, Any]:
    """The form errors of a redisplayed admin form (a 302 would mean it was saved)."""
    assert response.status_code == 200
    return dict(response.context["adminform"].form.errors)


@pytest.fixture
def foreign(tenant_b: Tenant, outsider_b: Persona, held: Any) -> dict[str, Any]:
    """Tenant B's policy, hold point and webhook (held first: its sandbox serves both)."""
    policy_b = ApprovalPolicy.objects.create(
        tenant=tenant_b, name="globex rule", tool="tasks.create"
    )
    run = create_run(tenant_b, "api-review", GOAL, actor="agent:agent-b")
    assert advance_run(run.run_id, "w2").outcome == "waiting"
    hook_b = TenantWebhook.objects.create(tenant=tenant_b, url="https://globex.example/hook")
    delivery_b = WebhookDelivery.objects.create(
        webhook=hook_b, event_type="approval.requested", message_id="msg_globex", attempt=1
    )
    return {
        "policy": policy_b,
        "request": ApprovalRequest.objects.get(run=run),
        "webhook": hook_b,
        "delivery": delivery_b,
        "group": Group.objects.get(name="globex-reviewers"),
    }


def test_tenant_admin_sees_only_own_tenant(
    client: Client, admin_a: Persona, held: Any, foreign: dict[str, Any]
) -> None:
    _, request_a, _ = held
    hook_a = TenantWebhook.objects.create(tenant=admin_a.tenant, url="https://acme.example/hook")
    WebhookDelivery.objects.create(
        webhook=hook_a, event_type="approval.requested", message_id="msg_acme", attempt=1
    )
    client.force_login(admin_a.user)
    index = client.get("/admin/").content
    for section in (b"Approval policies", b"Approval requests", b"Tenant webhooks"):
        assert section in index
    assert b"Webhook deliveries" in index

    listing = {url: client.get(url) for url in (POLICIES, REQUESTS, WEBHOOKS, DELIVERIES)}
    assert all(page.status_code == 200 for page in listing.values())
    assert b"tasks need review" in listing[POLICIES].content
    assert b"globex rule" not in listing[POLICIES].content
    assert str(request_a.id).encode() in listing[REQUESTS].content
    assert str(foreign["request"].id).encode() not in listing[REQUESTS].content
    assert b"globex" not in listing[REQUESTS].content  # nor in its filters
    assert b"acme.example" in listing[WEBHOOKS].content
    assert b"globex.example" not in listing[WEBHOOKS].content
    assert b"msg_acme" in listing[DELIVERIES].content
    assert b"msg_globex" not in listing[DELIVERIES].content

    for url in [
        f"{POLICIES}{foreign['policy'].pk}/change/",
        f"{REQUESTS}{foreign['request'].pk}/change/",
        f"{WEBHOOKS}{foreign['webhook'].pk}/change/",
        f"{WEBHOOKS}{foreign['webhook'].pk}/delete/",
        f"{DELIVERIES}{foreign['delivery'].pk}/change/",
    ]:
        response = client.get(url)
        assert response.status_code == 302 and response["Location"] == "/admin/", url


def test_group_choices_are_the_tenants_own(
    client: Client, admin_a: Persona, policy: ApprovalPolicy, foreign: dict[str, Any]
) -> None:
    # A tenant whose slug extends A's: its groups are its own, not A's.
    Tenant.objects.create(slug="acme-corp", name="Acme Corp")
    Group.objects.create(name="acme-corp-reviewers")
    Group.objects.create(name="acme-oncall")
    client.force_login(admin_a.user)

    for url in (f"{POLICIES}add/", f"{POLICIES}{policy.pk}/change/"):
        page = client.get(url).content
        assert b"acme-reviewers" in page and b"acme-oncall" in page, url
        for absent in (b"globex", b"acme-corp", b"tenant-admins", b"Globex"):
            assert absent not in page, (url, absent)

    forged = client.post(
        f"{POLICIES}{policy.pk}/change/",
        _policy_form(policy, decider_groups=[foreign["group"].pk]),
    )
    assert "decider_groups" in _errors(forged)  # redisplayed with an error
    assert not may_decide(foreign["group"].user_set.get(), policy)
    forged_escalation = client.post(
        f"{POLICIES}{policy.pk}/change/",
        _policy_form(policy, escalation_group=Group.objects.get(name="acme-corp-reviewers").pk),
    )
    assert list(_errors(forged_escalation)) == ["escalation_group"]
    policy.refresh_from_db()
    assert policy.escalation_group is None

    created = client.post(
        f"{POLICIES}add/",
        {**_policy_form(policy, name="foreign tenant"), "tenant": foreign["policy"].tenant_id},
    )
    assert "tenant" in _errors(created)
    assert not ApprovalPolicy.objects.filter(name="foreign tenant").exists()


def test_granting_a_group_in_the_form_lets_its_members_decide(
    client: Client, admin_a: Persona, reviewer_a: Persona
) -> None:
    reviewers = Group.objects.get(name="acme-reviewers")
    client.force_login(admin_a.user)
    created = client.post(
        f"{POLICIES}add/",
        {**_policy_form(ApprovalPolicy(name="close needs review", tool="tasks.close"))}
        | {"tenant": admin_a.tenant.pk, "decider_groups": [reviewers.pk]},
    )
    assert created.status_code == 302, created.content[:3000]
    policy = ApprovalPolicy.objects.get(name="close needs review")
    assert policy.tenant == admin_a.tenant
    assert may_decide(reviewer_a.user, policy)

    page = client.get(f"{POLICIES}{policy.pk}/change/")
    assert page.context["adminform"].form.initial["decider_groups"] == [reviewers.pk]

    removed = client.post(f"{POLICIES}{policy.pk}/change/", _policy_form(policy))
    assert removed.status_code == 302, removed.content[:3000]
    assert not may_decide(reviewer_a.user, policy)

    entries = JournalEntry.objects.filter(
        stream=f"tenant:{admin_a.tenant.pk}", type="policy_changed"
    ).order_by("seq")
    assert [(e.actor, e.payload["granted"], e.payload["revoked"]) for e in entries] == [
        ("user:ada", ["acme-reviewers"], []),
        ("user:ada", [], ["acme-reviewers"]),
    ]


def test_bad_condition_and_duplicate_name_are_form_errors(
    client: Client, admin_a: Persona, policy: ApprovalPolicy
) -> None:
    other = ApprovalPolicy.objects.create(tenant=admin_a.tenant, name="other", tool="tasks.close")
    client.force_login(admin_a.user)
    url = f"{POLICIES}{other.pk}/change/"
    for condition in ('{"target_matches": "(["}', '{"param": "x", "op": "between"}', "[1]"):
        response = client.post(url, _policy_form(other, condition=condition))
        assert list(_errors(response)) == ["condition"], condition
    assert list(_errors(client.post(url, _policy_form(other, name=policy.name)))) == ["name"]
    ok = client.post(url, _policy_form(other, condition='{"param": "n", "op": "gt", "value": 3}'))
    assert ok.status_code == 302
    other.refresh_from_db()
    assert other.condition == {"param": "n", "op": "gt", "value": 3}


def test_a_nul_in_a_condition_is_a_form_error_not_a_500(
    client: Client, admin_a: Persona, policy: ApprovalPolicy
) -> None:
    """PostgreSQL's JSONB cannot hold \\u0000: a condition with a NUL in a value, a param
    name or a pattern answered 500 when saved there (SQLite stored it). It is refused on
    the form on both, and the policy keeps its condition."""
    client.force_login(admin_a.user)
    url = f"{POLICIES}{policy.pk}/change/"
    for condition in (
        '{"param": "title", "value": "a\\u0000b"}',
        '{"param": "ti\\u0000tle", "value": 1}',
        '{"param": "tags", "op": "contains", "value": ["\\u0000"]}',
        '{"target_matches": "^prod\\u0000"}',
    ):
        response = client.post(url, _policy_form(policy, condition=condition))
        assert response.status_code == 200, condition
        assert list(_errors(response)) == ["condition"], condition
        assert "NUL" in str(_errors(response)["condition"])
    policy.refresh_from_db()
    assert policy.condition is None


def test_the_condition_field_explains_itself_and_no_condition_reads_always(
    client: Client, admin_a: Persona
) -> None:
    """A policy without a condition showed `null` in an unexplained box (issue 20): now the
    box is empty with "(always)" in it, the help shows the syntax with examples, and the
    list says what each policy's condition is."""
    always = ApprovalPolicy.objects.create(tenant=admin_a.tenant, name="all", tool="tasks.create")
    big = ApprovalPolicy.objects.create(
        tenant=admin_a.tenant,
        name="big",
        tool="payments.send",
        condition={"param": "amount", "op": "gt", "value": 100},
    )
    client.force_login(admin_a.user)
    page = client.get(f"{POLICIES}{always.pk}/change/")
    html = page.content.decode()
    field = page.context["adminform"].form["condition"]
    assert field.value() == "" and ">null<" not in html
    assert 'placeholder="(always) — every action of the tool"' in html
    help_text = str(field.help_text)
    assert '{"param": "amount", "op": "gt", "value": 100}' in help_text
    assert '{"target_matches": "^prod-"}' in help_text and "gte" in help_text
    # Saved with the box left empty: still no condition.
    assert client.post(f"{POLICIES}{always.pk}/change/", _policy_form(always)).status_code == 302
    always.refresh_from_db()
    assert always.condition is None
    # An existing condition is shown as its JSON, to edit.
    shown = client.get(f"{POLICIES}{big.pk}/change/").context["adminform"].form["condition"]
    assert '"op": "gt"' in str(shown.value())

    listed = client.get(POLICIES).content.decode()
    assert "(always)" in listed and "amount gt 100" in listed


def test_requests_are_read_only(client: Client, admin_a: Persona, held: Any) -> None:
    _, request, _ = held
    client.force_login(admin_a.user)
    url = f"{REQUESTS}{request.pk}/change/"
    page = client.get(url)
    assert page.status_code == 200 and request.title.encode() in page.content
    assert b'name="_save"' not in page.content and b"<textarea" not in page.content
    assert client.post(url, {"status": "approved"}).status_code == 403
    assert client.get(f"{REQUESTS}add/").status_code == 403
    assert client.post(f"{REQUESTS}{request.pk}/delete/", {"post": "yes"}).status_code == 403
    request.refresh_from_db()
    assert request.status == "pending"

    root = type(admin_a.user).objects.create_superuser("root", password="pw")
    client.force_login(root)  # operators too: requests change only through decisions
    assert b'name="_save"' not in client.get(url).content
    assert client.post(url, {"status": "approved"}).status_code == 403


def test_webhook_admin_generates_and_shows_the_secret(
    client: Client, admin_a: Persona, tenant_b: Tenant
) -> None:
    client.force_login(admin_a.user)
    form = client.get(f"{WEBHOOKS}add/").content
    assert b"Globex" not in form and b"globex" not in form and b'name="secret"' not in form
    created = client.post(
        f"{WEBHOOKS}add/",
        {
            "tenant": admin_a.tenant.pk,
            "url": "https://hooks.acme.example/holdpoint",
            "active": "on",
            "event_types": ["approval.requested", "approval.decided"],
            "secret": "whsec_Y2hvc2VuLWJ5LXRoZS1hdHRhY2tlcg==",  # ignored: not a form field
        },
    )
    assert created.status_code == 302, created.content[:3000]
    hook = TenantWebhook.objects.get(tenant=admin_a.tenant)
    assert hook.event_types == ["approval.requested", "approval.decided"]
    assert hook.secret.startswith("whsec_") and "Y2hvc2Vu" not in hook.secret

    page = client.get(f"{WEBHOOKS}{hook.pk}/change/").content
    assert hook.secret.encode() in page and b'name="secret"' not in page
    assert JournalEntry.objects.filter(type="webhook_changed", actor="user:ada").exists()

    stolen = client.post(
        f"{WEBHOOKS}add/",
        {"tenant": tenant_b.pk, "url": "https://x.example/", "event_types": ["approval.decided"]},
    )
    assert "tenant" in _errors(stolen)
    assert not TenantWebhook.objects.filter(tenant=tenant_b).exists()
    bad_url = client.post(
        f"{WEBHOOKS}add/",
        {"tenant": admin_a.tenant.pk, "url": "ftp://x.example/", "event_types": []},
    )
    assert {"url", "event_types"} <= set(_errors(bad_url))
    # What delivery would refuse of the URL itself is said on the form, not at each event.
    with_password = client.post(
        f"{WEBHOOKS}add/",
        {
            "tenant": admin_a.tenant.pk,
            "url": "https://hook:s3cret@hooks.acme.example/holdpoint",
            "event_types": ["approval.decided"],
        },
    )
    assert _errors(with_password) == {"url": ["the URL may not contain a user name or password"]}
    # A host written as an address needs no DNS to be judged: a private or metadata one is
    # refused on the form (a name is judged at each delivery, as it may resolve elsewhere).
    for host in ("169.254.169.254", "10.1.2.3", "[::ffff:127.0.0.1]", "[64:ff9b::a9fe:a9fe]"):
        inside = client.post(
            f"{WEBHOOKS}add/",
            {"tenant": admin_a.tenant.pk, "url": f"http://{host}/hook", "event_types": []},
        )
        assert "not a public address" in _errors(inside)["url"][0], host
    assert TenantWebhook.objects.count() == 1
    with override_settings(HOLDPOINT_WEBHOOK_PRIVATE_NETWORKS=["10.0.0.0/8"]):
        internal = client.post(
            f"{WEBHOOKS}add/",
            {
                "tenant": admin_a.tenant.pk,
                "url": "http://10.1.2.3:8080/hook",
                "event_types": ["approval.decided"],
            },
        )
    assert internal.status_code == 302, _errors(internal)
    assert TenantWebhook.objects.count() == 2


def test_admin_of_two_tenants_cannot_cross_grant(
    client: Client, admin_a: Persona, reviewer_a: Persona
) -> None:
    """Both tenants' groups are offered on the add form; the chosen tenant decides which
    of them may be granted."""
    initech = Tenant.objects.create(slug="initech", name="Initech")
    Membership.objects.create(tenant=initech, user=admin_a.user, role=Role.ADMIN)
    theirs = Group.objects.create(name="initech-reviewers")
    client.force_login(admin_a.user)
    form = client.get(f"{POLICIES}add/").content
    assert b"initech-reviewers" in form and b"acme-reviewers" in form
    template = ApprovalPolicy(name="cross", tool="tasks.close")
    response = client.post(
        f"{POLICIES}add/",
        _policy_form(template, decider_groups=[theirs.pk], escalation_group=theirs.pk)
        | {"tenant": admin_a.tenant.pk},
    )
    assert set(_errors(response)) == {"decider_groups", "escalation_group"}
    assert not ApprovalPolicy.objects.filter(name="cross").exists()


def test_webhook_bulk_delete_is_journalled(
    client: Client, admin_a: Persona, tenant_b: Tenant
) -> None:
    ours = TenantWebhook.objects.create(tenant=admin_a.tenant, url="https://acme.example/a")
    theirs = TenantWebhook.objects.create(tenant=tenant_b, url="https://globex.example/b")
    client.force_login(admin_a.user)
    response = client.post(
        WEBHOOKS,
        {"action": "delete_selected", "_selected_action": [ours.pk, theirs.pk], "post": "yes"},
    )
    assert response.status_code == 302
    assert list(TenantWebhook.objects.all()) == [theirs]  # a foreign id is not in the queryset
    assert JournalEntry.objects.get(type="webhook_deleted").payload == {"url": ours.url}


def test_the_expiry_choice_says_what_the_default_does_for_every_run(
    client: Client, admin_a: Persona
) -> None:
    """The default's label said "Re-request once, then needs attention", which is not what
    happens to an MCP session's run (its host gets the rejection and the run goes on:
    tests/approvals/test_expiry_outcome.py). The form's choice and the list say both."""
    label = (
        "Re-request once, then reject: the run needs attention "
        "(MCP sessions: the host gets the rejection)"
    )
    policy = ApprovalPolicy.objects.create(tenant=admin_a.tenant, name="all", tool="tasks.create")
    client.force_login(admin_a.user)
    form = client.get(f"{POLICIES}{policy.pk}/change/").context["adminform"].form
    choices = dict(form.fields["on_expiry"].choices)
    assert choices["rerequest"] == label and form["on_expiry"].value() == "rerequest"
    html = client.get(f"{POLICIES}{policy.pk}/change/").content.decode()
    assert f'<option value="rerequest" selected>{escape(label)}</option>' in html
    listed = client.get(POLICIES).content.decode()
    assert escape(label) in listed and "then needs attention" not in listed
