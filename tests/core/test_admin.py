"""Django admin: operators see everything; a tenant admin only their own tenant."""

from __future__ import annotations

import re

from django.contrib import admin
from django.contrib.auth import get_user_model
from django.test import Client

from runtime.models import AgentToken, Membership, Role, Tenant
from tests.conftest import Persona

User = get_user_model()


def _login(client: Client, persona: Persona) -> Client:
    client.force_login(persona.user)
    return client


def test_tenant_admin_lists_only_own_memberships(
    client: Client, admin_a: Persona, reviewer_a: Persona, outsider_b: Persona
) -> None:
    page = _login(client, admin_a).get("/admin/runtime/membership/")
    assert page.status_code == 200
    assert b"alice" in page.content
    assert b"bob" not in page.content


def test_tenant_admin_cannot_open_other_tenants_objects(
    client: Client, admin_a: Persona, outsider_b: Persona, agent_b: Persona
) -> None:
    _login(client, admin_a)
    foreign = Membership.objects.get(user=outsider_b.user)
    for url in [
        f"/admin/runtime/membership/{foreign.pk}/change/",
        f"/admin/runtime/tenant/{outsider_b.tenant.pk}/change/",
        f"/admin/runtime/agentaccount/{agent_b.user.pk}/change/",
        f"/admin/runtime/agenttoken/{AgentToken.objects.get(user=agent_b.user).pk}/change/",
        f"/admin/runtime/membership/{foreign.pk}/delete/",
        f"/admin/runtime/membership/{foreign.pk}/history/",
    ]:
        response = client.get(url)
        # Django admin answers an object outside the queryset with a redirect to the index
        # and "doesn't exist" — the same as for an id that was never used.
        assert response.status_code == 302, url
        assert response["Location"] == "/admin/", url
    listing = client.get("/admin/runtime/tenant/")
    assert b"globex" not in listing.content and b"acme" in listing.content


def test_tenant_admin_choices_are_own_tenant_only(
    client: Client, admin_a: Persona, outsider_b: Persona
) -> None:
    form = _login(client, admin_a).get("/admin/runtime/membership/add/")
    assert form.status_code == 200
    assert b"Globex" not in form.content and b"globex" not in form.content
    assert b"bob" not in form.content

    # Forging a foreign tenant id in the POST is refused by the narrowed choice field.
    response = client.post(
        "/admin/runtime/membership/add/",
        {"tenant": outsider_b.tenant.pk, "user": admin_a.user.pk, "role": Role.VIEWER},
    )
    assert response.status_code == 200  # form redisplayed with an error
    assert not Membership.objects.filter(tenant=outsider_b.tenant, user=admin_a.user).exists()


def test_tenant_admin_creates_agent_and_token_in_own_tenant(
    client: Client, admin_a: Persona, agent_b: Persona
) -> None:
    _login(client, admin_a)
    created = client.post(
        "/admin/runtime/agentaccount/add/",
        {"username": "new-bot", "is_active": "on", "tenant": admin_a.tenant.pk},
    )
    assert created.status_code == 302, created.content[:2000]
    bot = User.objects.get(username="new-bot")
    assert not bot.has_usable_password()
    assert Membership.objects.get(user=bot).role == Role.AGENT

    token_form = client.get("/admin/runtime/agenttoken/add/")
    assert b"new-bot" in token_form.content and b"agent-b" not in token_form.content
    assert client.post("/admin/runtime/agenttoken/add/", {"user": bot.pk}).status_code == 302
    assert AgentToken.objects.filter(user=bot, tenant=admin_a.tenant).exists()
    stolen = client.post("/admin/runtime/agenttoken/add/", {"user": agent_b.user.pk})
    assert stolen.status_code == 200
    tokens = client.get("/admin/runtime/agenttoken/")
    assert b"new-bot" in tokens.content and b"agent-b" not in tokens.content


def test_tenant_admin_cannot_create_tenants_or_see_users(client: Client, admin_a: Persona) -> None:
    _login(client, admin_a)
    assert client.get("/admin/runtime/tenant/add/").status_code == 403
    assert client.get("/admin/auth/user/").status_code == 403


def test_superuser_sees_every_tenant(client: Client, tenant_a: Tenant, tenant_b: Tenant) -> None:
    root = User.objects.create_superuser("root", password="pw")
    client.force_login(root)
    page = client.get("/admin/runtime/tenant/")
    assert b"acme" in page.content and b"globex" in page.content


def test_the_admin_index_names_its_tables_in_english(client: Client, db: None) -> None:
    root = User.objects.create_superuser("root", password="pw")
    client.force_login(root)
    page = client.get("/admin/").content.decode()
    assert "Journal entries" in page and "MCP servers" in page
    assert "Journal entrys" not in page and "Mcp servers" not in page


def test_every_admin_table_has_an_english_plural() -> None:
    """Django's default plural adds an "s" ("Journal entrys", issue 20): every model in the
    admin, ours and the libraries', reads as English, and acronyms stay capitals."""
    wrong = []
    for model in admin.site._registry:
        singular = str(model._meta.verbose_name)
        plural = str(model._meta.verbose_name_plural)
        if re.search(r"[^aeiou]y$", singular):
            expected = singular[:-1] + "ies"
        elif re.search(r"(s|x|z|ch|sh)$", singular):
            expected = singular + "es"
        else:
            expected = singular + "s"
        if plural != expected or re.search(r"\b(Mcp|Api|Url|Http|Json)\b", plural):
            wrong.append(f"{model.__name__}: {plural!r}")
    assert not wrong, wrong
