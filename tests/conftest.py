"""Personas and helpers shared by every test area (STYLE.md, "Tests")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser, Group
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from runtime.models import Membership, Role, Tenant

User = get_user_model()


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


def make_persona(tenant: Tenant, username: str, role: str, **user_fields: Any) -> Persona:
    user = User.objects.create_user(username=username, password="pw-" + username, **user_fields)
    Membership.objects.create(tenant=tenant, user=user, role=role)
    token = Token.objects.create(user=user).key if role == Role.AGENT else None
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
    from runtime.management.commands.seed_demo import Command

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
