"""Agent tokens (issue 9): hash-only storage, refusal at once, rotation without downtime,
tenant-scoped admin, journalled changes, and the carry-over of DRF's tokens."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from datetime import timedelta
from io import StringIO
from types import SimpleNamespace
from typing import Any

import pytest
import time_machine
from django.apps import apps
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from audit.journal import tenant_stream
from audit.models import JournalEntry
from audit.verification import verify_stream
from runtime.auth import issue_token, revoke_token, rotate_tokens
from runtime.models import AgentToken, Membership, Role, Tenant
from runtime.models.tokens import PREFIX_LENGTH, hash_key, new_key
from tests.api import problem
from tests.approvals.conftest import held, policy  # noqa: F401 — fixtures
from tests.conftest import Persona, make_persona

User = get_user_model()
RUNS = "/api/v1/runs/"


@pytest.fixture(autouse=True)
def fresh_throttle() -> Iterator[None]:
    """The per-token request rate is counted in the process cache; start each test at zero."""
    from django.core.cache import cache

    cache.clear()
    yield
    cache.clear()


def call(key: str, url: str = RUNS) -> Any:
    return APIClient().get(url, HTTP_AUTHORIZATION=f"Token {key}")


def refused(response: Any) -> dict[str, Any]:
    """401 in the problem format, with the scheme to use."""
    data = problem(response, 401, "not_authenticated")
    assert response["WWW-Authenticate"] == "Token"
    return data


def rotate(username: str, *args: str) -> tuple[str, str]:
    """`manage.py agent_token rotate`; (output, new key)."""
    out = StringIO()
    call_command("agent_token", "rotate", username, *args, stdout=out)
    return out.getvalue(), out.getvalue().splitlines()[-1]


# --- refusal at once ------------------------------------------------------------------


def test_a_revoked_token_is_refused_on_the_next_request(agent_a: Persona) -> None:
    client = agent_a.api()
    assert client.get(RUNS).status_code == 200
    token = AgentToken.objects.get(user=agent_a.user)
    assert revoke_token(token, actor="user:ada")
    refused(client.get(RUNS))  # same process, same client, the very next request
    assert not revoke_token(token, actor="user:ada")  # twice: nothing more recorded
    entries = JournalEntry.objects.filter(stream=tenant_stream(agent_a.tenant.pk))
    assert list(entries.filter(type="token_revoked").values_list("actor", flat=True)) == [
        "user:ada"
    ]


@pytest.mark.parametrize("change", ["deactivated", "membership_gone", "tenant_deactivated"])
def test_a_token_dies_with_its_user_membership_or_tenant(agent_a: Persona, change: str) -> None:
    client = agent_a.api()
    assert client.get(RUNS).status_code == 200
    if change == "deactivated":
        User.objects.filter(pk=agent_a.user.pk).update(is_active=False)
    elif change == "membership_gone":
        Membership.objects.filter(user=agent_a.user).delete()
    else:
        Tenant.objects.filter(pk=agent_a.tenant.pk).update(active=False)
    refused(client.get(RUNS))


def test_every_refusal_reads_the_same(agent_a: Persona, agent_b: Persona) -> None:
    """Unknown, revoked, expired or deactivated: one answer, so a key tells nothing."""
    revoked = issue_token(agent_a.user, actor="t")
    revoke_token(revoked.token, actor="t")
    expired = issue_token(agent_a.user, actor="t", expires_at=timezone.now() - timedelta(1))
    User.objects.filter(pk=agent_b.user.pk).update(is_active=False)
    bodies = {
        call(key).content
        for key in ["hpt_" + "x" * 43, revoked.key, expired.key, agent_b.token or ""]
    }
    assert len(bodies) == 1
    refused(call(revoked.key))


# --- rotation -------------------------------------------------------------------------


def test_rotation_keeps_both_tokens_valid_during_the_window_then_only_the_new(
    agent_a: Persona,
) -> None:
    old = agent_a.token or ""
    with time_machine.travel(timezone.now(), tick=False) as clock:
        output, new = rotate("agent-a", "--overlap", "2h")
        assert new != old and new.startswith("hpt_")
        assert call(old).status_code == 200 and call(new).status_code == 200
        clock.shift(timedelta(hours=2) - timedelta(seconds=1))
        assert call(old).status_code == 200 and call(new).status_code == 200
        clock.shift(timedelta(seconds=2))
        refused(call(old))
        assert call(new).status_code == 200
    assert f"Old token {old[:12]}… works until" in output and old not in output
    rotated = JournalEntry.objects.get(
        stream=tenant_stream(agent_a.tenant.pk), type="token_rotated"
    )
    assert rotated.payload["token_prefix"] == new[:12]
    assert [r["token_prefix"] for r in rotated.payload["replaced"]] == [old[:12]]
    assert rotated.actor.startswith("system:agent_token")


def test_rotating_one_token_leaves_the_agents_other_tokens_alone(agent_a: Persona) -> None:
    other = issue_token(agent_a.user, actor="t", name="second host")
    old = AgentToken.objects.authenticate(agent_a.token or "")
    assert old is not None
    issued, replaced = rotate_tokens(agent_a.user, actor="t", replace=[old], overlap=timedelta(0))
    assert replaced == [old]
    refused(call(agent_a.token or ""))
    assert call(other.key).status_code == 200 and call(issued.key).status_code == 200


def test_an_earlier_expiry_is_not_extended_by_rotation(agent_a: Persona) -> None:
    soon = timezone.now() + timedelta(minutes=5)
    AgentToken.objects.filter(user=agent_a.user).update(expires_at=soon)
    rotate_tokens(agent_a.user, actor="t", overlap=timedelta(hours=24))
    assert AgentToken.objects.get(user=agent_a.user, expires_at__isnull=False).expires_at == soon


# --- storage --------------------------------------------------------------------------


def test_only_a_hash_and_a_short_prefix_are_stored(agent_a: Persona) -> None:
    key = agent_a.token or ""
    assert len(key) >= 40
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM runtime_agenttoken")
        columns = [c[0] for c in cursor.description]
        rows = cursor.fetchall()
    assert len(rows) == 1
    stored = dict(zip(columns, rows[0], strict=True))
    assert all(key not in str(value) for value in stored.values())
    assert stored["key_hash"] == hashlib.sha256(key.encode()).hexdigest()
    assert stored["prefix"] == key[:12] and len(stored["prefix"]) == 12
    # ... and neither the key nor its hash reaches the journal.
    for entry in JournalEntry.objects.all():
        text = str(entry.payload)
        assert key not in text and stored["key_hash"] not in text


def test_last_use_is_written_at_most_once_a_minute(agent_a: Persona) -> None:
    with time_machine.travel(timezone.now(), tick=False) as clock:
        first = timezone.now()
        assert call(agent_a.token or "").status_code == 200
        token = AgentToken.objects.get(user=agent_a.user)
        assert token.last_used_at == first
        clock.shift(timedelta(seconds=30))
        call(agent_a.token or "")
        token.refresh_from_db()
        assert token.last_used_at == first
        clock.shift(timedelta(seconds=31))
        call(agent_a.token or "")
        token.refresh_from_db()
        assert token.last_used_at == first + timedelta(seconds=61)


# --- the command ----------------------------------------------------------------------


def test_command_issues_lists_and_revokes_without_ever_printing_a_hash(agent_a: Persona) -> None:
    out = StringIO()
    call_command(
        "agent_token", "issue", "agent-a", "--name", "ci", "--expires-in", "7d", stdout=out
    )
    key = out.getvalue().splitlines()[-1]
    token = AgentToken.objects.authenticate(key)
    assert token is not None and token.name == "ci" and token.expires_at is not None
    listing = StringIO()
    call_command("agent_token", "list", "agent-a", stdout=listing)
    assert token.prefix in listing.getvalue() and "expiring" in listing.getvalue()
    assert key not in listing.getvalue() and token.key_hash not in listing.getvalue()
    call_command("agent_token", "revoke", "agent-a", "--prefix", token.prefix, stdout=StringIO())
    refused(call(key))
    assert call(agent_a.token or "").status_code == 200
    stream = JournalEntry.objects.filter(stream=tenant_stream(agent_a.tenant.pk))
    kinds = stream.order_by("seq").values_list("type", flat=True)  # no order is no order
    assert list(kinds)[-2:] == ["token_created", "token_revoked"]
    assert verify_stream(tenant_stream(agent_a.tenant.pk)) is None


# --- tokens are for agent accounts only (issue 15, part 5) -------------------------------


def test_a_person_gets_no_token_from_the_command_or_the_function(reviewer_a: Persona) -> None:
    for action in ("issue", "rotate"):
        with pytest.raises(CommandError, match="API tokens are for agent accounts only"):
            call_command("agent_token", action, "alice", stdout=StringIO())
    with pytest.raises(ValueError, match="agent accounts only"):
        issue_token(reviewer_a.user, actor="t")
    with pytest.raises(ValueError, match="agent accounts only"):
        rotate_tokens(reviewer_a.user, actor="t", tenant=reviewer_a.tenant)
    assert not AgentToken.objects.filter(user=reviewer_a.user).exists()
    stream = JournalEntry.objects.filter(stream=tenant_stream(reviewer_a.tenant.pk))
    assert not stream.filter(type__in=["token_created", "token_rotated"]).exists()


def test_the_admin_offers_and_accepts_no_person(
    client: Client, admin_a: Persona, reviewer_a: Persona, agent_a: Persona
) -> None:
    _admin(client, admin_a)
    form = client.get("/admin/runtime/agenttoken/add/").content.decode()
    assert f'value="{agent_a.user.pk}"' in form
    assert f'value="{reviewer_a.user.pk}"' not in form and f'value="{admin_a.user.pk}"' not in form
    for person in (reviewer_a, admin_a):
        page = client.post("/admin/runtime/agenttoken/add/", {"user": person.user.pk})
        assert page.status_code == 200 and "Select a valid choice" in page.content.decode()
        assert not AgentToken.objects.filter(user=person.user).exists()


def _persons_token(persona: Persona) -> tuple[AgentToken, str]:
    """A token of a person, as one issued before the rule (written directly: nothing issues
    one any more)."""
    key = new_key()
    token = AgentToken.objects.create(
        tenant=persona.tenant,
        user=persona.user,
        prefix=key[:PREFIX_LENGTH],
        key_hash=hash_key(key),
        created_by="user:ada",
    )
    return token, key


def test_a_persons_existing_token_cannot_decide_over_the_api(
    reviewer_a: Persona, request: pytest.FixtureRequest
) -> None:
    _, pending, box = request.getfixturevalue("held")
    _, key = _persons_token(reviewer_a)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    answer = client.post(
        f"/api/v1/approvals/{pending.pk}/decision/",
        {"decision": "approve", "action_hash": pending.action_hash},
        format="json",
    )
    refused(answer)
    refused(call(key))
    pending.refresh_from_db()
    assert pending.status == "pending" and box.tasks() == []


def test_the_migration_revokes_persons_tokens_and_journals_it(
    reviewer_a: Persona, agent_a: Persona
) -> None:
    from importlib import import_module

    migration = import_module("runtime.migrations.0016_revoke_human_tokens")
    theirs, _ = _persons_token(reviewer_a)
    migration.revoke(apps, SimpleNamespace(connection=connection))
    theirs.refresh_from_db()
    assert theirs.revoked_at is not None
    assert call(agent_a.token or "").status_code == 200  # agents' tokens are untouched
    assert AgentToken.objects.get(user=agent_a.user).revoked_at is None
    stream = tenant_stream(reviewer_a.tenant.pk)
    (entry,) = JournalEntry.objects.filter(stream=stream, type="token_revoked")
    assert entry.actor == "system:migration runtime.0016"
    assert entry.payload["token_prefix"] == theirs.prefix and entry.payload["agent"] == "alice"
    assert verify_stream(stream) is None
    migration.revoke(apps, SimpleNamespace(connection=connection))  # again: nothing more
    assert JournalEntry.objects.filter(stream=stream, type="token_revoked").count() == 1


# --- the admin ------------------------------------------------------------------------


def _admin(client: Client, persona: Persona) -> Client:
    client.force_login(persona.user)
    return client


def test_admin_shows_a_new_key_once_and_never_the_hash(client: Client, admin_a: Persona) -> None:
    bot = make_persona(admin_a.tenant, "bot-1", Role.AGENT)
    _admin(client, admin_a)
    page = client.post("/admin/runtime/agenttoken/add/", {"user": bot.user.pk}, follow=True)
    assert page.status_code == 200
    token = AgentToken.objects.filter(user=bot.user).order_by("-pk").first()
    assert token is not None and token.created_by == "user:ada"
    text = page.content.decode()
    key = text.split("cannot be recovered: ")[1].split("<")[0].strip()
    assert AgentToken.objects.authenticate(key) == token
    again = client.get(f"/admin/runtime/agenttoken/{token.pk}/change/").content.decode()
    listing = client.get("/admin/runtime/agenttoken/").content.decode()
    for html in (again, listing):
        assert token.prefix in html
        assert key not in html and token.key_hash not in html


def test_tenant_admin_sees_and_revokes_only_own_tenants_tokens(
    client: Client, admin_a: Persona, agent_a: Persona, agent_b: Persona
) -> None:
    mine = AgentToken.objects.get(user=agent_a.user)
    theirs = AgentToken.objects.get(user=agent_b.user)
    _admin(client, admin_a)
    listing = client.get("/admin/runtime/agenttoken/").content.decode()
    assert mine.prefix in listing and theirs.prefix not in listing and "agent-b" not in listing
    change = client.get(f"/admin/runtime/agenttoken/{theirs.pk}/change/")
    assert change.status_code == 302 and change["Location"] == "/admin/"
    for action in ("revoke_selected", "rotate_selected"):
        client.post(
            "/admin/runtime/agenttoken/",
            {"action": action, "_selected_action": [theirs.pk]},
        )
    theirs.refresh_from_db()
    assert theirs.revoked_at is None and theirs.expires_at is None
    assert AgentToken.objects.filter(user=agent_b.user).count() == 1
    assert call(agent_b.token or "").status_code == 200
    # The same actions work on their own tenant's token.
    client.post(
        "/admin/runtime/agenttoken/", {"action": "revoke_selected", "_selected_action": [mine.pk]}
    )
    refused(call(agent_a.token or ""))


def test_admin_rotation_issues_a_new_key_and_keeps_the_old_one_for_a_day(
    client: Client, admin_a: Persona, agent_a: Persona
) -> None:
    old = AgentToken.objects.get(user=agent_a.user)
    _admin(client, admin_a)
    page = client.post(
        "/admin/runtime/agenttoken/",
        {"action": "rotate_selected", "_selected_action": [old.pk]},
        follow=True,
    )
    key = page.content.decode().split("cannot be recovered: ")[1].split("<")[0].strip()
    old.refresh_from_db()
    assert old.expires_at is not None
    assert timedelta(hours=23) < old.expires_at - timezone.now() <= timedelta(hours=24)
    assert call(key).status_code == 200 and call(agent_a.token or "").status_code == 200


def test_tokens_cannot_be_deleted_or_edited_from_the_admin(
    client: Client, admin_a: Persona, agent_a: Persona
) -> None:
    token = AgentToken.objects.get(user=agent_a.user)
    _admin(client, admin_a)
    assert client.get(f"/admin/runtime/agenttoken/{token.pk}/delete/").status_code == 403
    client.post(
        f"/admin/runtime/agenttoken/{token.pk}/change/",
        {"name": "renamed", "expires_at_0": "2000-01-01", "expires_at_1": "00:00:00"},
    )
    token.refresh_from_db()
    assert token.name == "" and token.expires_at is None


# --- carrying DRF's tokens over ---------------------------------------------------------


def test_existing_drf_tokens_keep_working_after_the_migration(agent_a: Persona) -> None:
    """The data step of 0012: an agent's DRF key authenticates afterwards; the table that
    held keys in clear is gone."""
    from importlib import import_module

    migration = import_module("runtime.migrations.0012_agent_tokens_secrets")
    drf_key = "0123456789abcdef0123456789abcdef01234567"
    kind = "timestamp with time zone" if connection.vendor == "postgresql" else "datetime"
    with connection.cursor() as cursor:
        cursor.execute(
            f'CREATE TABLE "authtoken_token" ("key" varchar(40) PRIMARY KEY, '
            f'"created" {kind} NOT NULL, "user_id" integer NOT NULL)'
        )
        cursor.execute(
            'INSERT INTO "authtoken_token" VALUES (%s, %s, %s)',
            [drf_key, timezone.now(), agent_a.user.pk],
        )
    refused(call(drf_key))
    migration.copy_drf_tokens(apps, SimpleNamespace(connection=connection))
    assert call(drf_key).status_code == 200
    carried = AgentToken.objects.get(prefix=drf_key[:8])
    assert carried.tenant == agent_a.tenant and carried.key_hash != drf_key
    assert "authtoken_token" not in connection.introspection.table_names()
