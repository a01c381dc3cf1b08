"""Tenant isolation through the scoping helpers: another tenant's object is not found."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from runtime.errors import NotFound
from runtime.models import Membership, Role, Tenant
from runtime.tenancy import get_scoped, memberships_for, principal_for, tenants_for
from tests.conftest import Persona, make_persona


def test_principal_is_the_users_tenant(reviewer_a: Persona, outsider_b: Persona) -> None:
    principal = principal_for(reviewer_a.user)
    assert principal is not None
    assert principal.tenant == reviewer_a.tenant
    assert principal.role == Role.REVIEWER


def test_other_tenants_object_is_not_found(reviewer_a: Persona, outsider_b: Persona) -> None:
    principal = principal_for(reviewer_a.user)
    foreign = Membership.objects.get(user=outsider_b.user)
    own = Membership.objects.get(user=reviewer_a.user)
    assert get_scoped(Membership.objects.all(), principal, pk=own.pk) == own
    with pytest.raises(NotFound):
        get_scoped(Membership.objects.all(), principal, pk=foreign.pk)
    with pytest.raises(NotFound):
        get_scoped(Membership.objects.all(), principal, pk="not-a-number")
    assert list(memberships_for(principal)) == [own]


def test_inactive_tenant_is_invisible(reviewer_a: Persona) -> None:
    Tenant.objects.filter(pk=reviewer_a.tenant.pk).update(active=False)
    assert principal_for(reviewer_a.user) is None
    assert list(tenants_for(reviewer_a.user)) == []


def test_switch_tenant_only_to_own_tenants(
    client: Client, reviewer_a: Persona, tenant_b: Tenant
) -> None:
    third = Tenant.objects.create(slug="initech", name="Initech")
    Membership.objects.create(tenant=third, user=reviewer_a.user, role=Role.VIEWER)
    client.force_login(reviewer_a.user)

    page = client.get(reverse("inbox"))
    assert page.status_code == 200
    assert b"Initech" in page.content and b"Globex" not in page.content

    moved = client.post(reverse("switch-tenant"), {"tenant": third.pk, "next": "/inbox/"})
    assert moved.status_code == 302
    assert client.get(reverse("inbox")).context["principal"].tenant == third

    refused = client.post(reverse("switch-tenant"), {"tenant": tenant_b.pk})
    assert refused.status_code == 404
    assert client.get(reverse("inbox")).context["principal"].tenant == third


def test_switch_tenant_refuses_get_and_offsite_next(client: Client, reviewer_a: Persona) -> None:
    client.force_login(reviewer_a.user)
    assert client.get(reverse("switch-tenant")).status_code == 405
    moved = client.post(
        reverse("switch-tenant"), {"tenant": reviewer_a.tenant.pk, "next": "https://evil.example/"}
    )
    assert moved["Location"] == reverse("inbox")


def test_agent_account_belongs_to_one_tenant(agent_a: Persona, tenant_b: Tenant) -> None:
    from django.core.exceptions import ValidationError

    second = Membership(tenant=tenant_b, user=agent_a.user, role=Role.AGENT)
    with pytest.raises(ValidationError):
        second.full_clean()


def test_user_without_tenant_sees_an_explanation(client: Client, db: None) -> None:
    lonely = make_persona(Tenant.objects.create(slug="x", name="X"), "lonely", Role.VIEWER)
    Membership.objects.filter(user=lonely.user).delete()
    client.force_login(lonely.user)
    page = client.get(reverse("inbox"))
    assert b"not a member of any active tenant" in page.content
