"""Tool credentials encrypted at rest (issue 9): ciphertext in the database, key rotation,
a clear error for a wrong key, the credential really sent to the tracker over a socket, and
the plaintext nowhere else — admin, logs, journal, exports, API responses, reprs."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.fernet import Fernet
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import Client
from rest_framework.test import APIClient

from audit.models import JournalEntry
from config.env import EnvError, env_fernet_keys
from runtime.crypto import Secret, SecretUnreadable
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Action, ActionStatus, Run, RunStatus, Tenant, ToolCredential
from runtime.tools import get_tool
from tests import procs
from tests.conftest import Persona
from tests.sandbox import Sandbox

PLAINTEXT = "tt-3f9c1e7a-credential-of-acme"
SANDBOX_TOKENS = [PLAINTEXT, "tt-other-tenant-token"]
GOAL = {
    "old_spec": "shop-v1",
    "new_spec": "shop-v2",
    "scope": ["/orders", "/users"],
    "create_review_task": True,
}
ROOT = Path(__file__).resolve().parents[2]


def store(tenant: Tenant, value: str = PLAINTEXT, service: str = "tasks") -> ToolCredential:
    credential = ToolCredential(tenant=tenant, service=service)
    credential.set_secret(value, actor="test")
    credential.save()
    return credential


@pytest.fixture
def keys(settings: Any) -> list[str]:
    """Two real Fernet keys; the first is current."""
    pair = [Fernet.generate_key().decode(), Fernet.generate_key().decode()]
    settings.HOLDPOINT_SECRET_KEYS = [pair[0]]
    return pair


@pytest.fixture
def locked_sandbox(tmp_path: Path, settings: Any) -> Iterator[Sandbox]:
    """The sandbox tracker requiring one of SANDBOX_TOKENS as a bearer token."""
    args = ["--mode", "key", "--data", str(tmp_path / "locked.sqlite3")]
    for token in SANDBOX_TOKENS:
        args += ["--require-token", token]
    proc, url = procs.start_listening(
        lambda port: ["sandbox_tasks", "--port", str(port), *args],
        procs.child_env(),
        tmp_path / "locked.log",
    )

    def up() -> bool:
        try:
            return httpx.get(url + "/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        procs.wait_for(up, timeout=30)
        settings.HOLDPOINT_TASKS_URL = url
        settings.HOLDPOINT_TASKS_DEDUP = "key"
        yield Sandbox(url, "key", proc)
    finally:
        procs.kill(proc)


def tasks(box: Sandbox, token: str = PLAINTEXT) -> Any:
    return httpx.get(box.url + "/tasks", headers={"Authorization": f"Bearer {token}"}).json()


# --- at rest ----------------------------------------------------------------------------


def test_the_database_holds_only_ciphertext(tenant_a: Tenant) -> None:
    credential = store(tenant_a)
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM runtime_toolcredential")
        row = " ".join(str(value) for value in cursor.fetchone())
    assert PLAINTEXT not in row
    assert credential.ciphertext in row and credential.ciphertext.startswith("gAAAAA")  # Fernet
    assert ToolCredential.objects.get().secret().reveal() == PLAINTEXT


def test_str_and_repr_never_show_the_secret(tenant_a: Tenant) -> None:
    credential = store(tenant_a)
    secret = credential.secret()
    for text in (str(credential), repr(credential), str(secret), repr(secret), f"{secret}"):
        assert PLAINTEXT not in text
    assert repr(secret) == "Secret('********')"
    assert isinstance(ToolCredential.lookup(tenant_a.pk, "tasks"), Secret)
    assert ToolCredential.lookup(tenant_a.pk, "elsewhere") is None


def test_a_ciphertext_copied_to_another_tenants_row_does_not_open(
    tenant_a: Tenant, tenant_b: Tenant
) -> None:
    mine = store(tenant_a)
    theirs = store(tenant_b, "their-own")
    ToolCredential.objects.filter(pk=theirs.pk).update(ciphertext=mine.ciphertext)
    with pytest.raises(SecretUnreadable, match="written for another credential"):
        ToolCredential.objects.get(pk=theirs.pk).secret()


# --- keys -------------------------------------------------------------------------------


def test_rotation_reencrypts_so_the_old_key_can_be_removed(
    tenant_a: Tenant, keys: list[str], settings: Any
) -> None:
    old_key, new_key = keys
    credential = store(tenant_a)
    before = credential.ciphertext
    settings.HOLDPOINT_SECRET_KEYS = [new_key, old_key]  # new first, old still readable
    assert ToolCredential.objects.get().secret().reveal() == PLAINTEXT
    out = StringIO()
    call_command("rotate_secrets", stdout=out)
    assert "Re-encrypted 1 credential(s)" in out.getvalue()
    credential.refresh_from_db()
    assert credential.ciphertext != before
    settings.HOLDPOINT_SECRET_KEYS = [new_key]  # the old key removed
    assert credential.secret().reveal() == PLAINTEXT
    with pytest.raises(SecretUnreadable):  # while the old ciphertext needed the old key
        ToolCredential(tenant=tenant_a, service="tasks", ciphertext=before).secret()
    entry = JournalEntry.objects.get(type="credentials_reencrypted")
    assert entry.payload == {"services": ["tasks"]} and entry.tenant_id == tenant_a.pk


def test_a_wrong_key_is_a_clear_error_never_garbage(
    tenant_a: Tenant, keys: list[str], settings: Any
) -> None:
    store(tenant_a)
    settings.HOLDPOINT_SECRET_KEYS = [keys[1]]  # a key it was never written with
    with pytest.raises(SecretUnreadable) as caught:
        ToolCredential.objects.get().secret()
    message = str(caught.value)
    assert "HOLDPOINT_SECRET_KEYS" in message and f"tenant {tenant_a.pk}" in message
    assert PLAINTEXT not in message
    with pytest.raises(CommandError, match="1 credential"):
        call_command("rotate_secrets", stdout=StringIO(), stderr=StringIO())
    run = create_run(tenant_a, "api-review", GOAL, actor="t")
    result = get_tool("tasks.create").call("{}", key="k", fence=1, run_id=str(run.run_id))
    assert result.outcome == "refused" and result.transient  # nothing sent, retried later
    assert "HOLDPOINT_SECRET_KEYS" in result.detail


def test_a_remembered_decryption_never_outlives_its_row_or_its_key(
    tenant_a: Tenant, tenant_b: Tenant, keys: list[str], settings: Any
) -> None:
    """Tools read a credential per call and remember its decryption: a removed key, a
    replaced or deleted secret, a ciphertext copied to another tenant all count at once."""
    credential = store(tenant_a)
    lookup = ToolCredential.lookup
    assert lookup(tenant_a.pk, "tasks").reveal() == PLAINTEXT  # decrypted and remembered
    settings.HOLDPOINT_SECRET_KEYS = [keys[1]]  # the key it was written with is gone
    with pytest.raises(SecretUnreadable):
        lookup(tenant_a.pk, "tasks")
    settings.HOLDPOINT_SECRET_KEYS = [keys[0]]
    theirs = store(tenant_b, "their-own")
    ToolCredential.objects.filter(pk=theirs.pk).update(ciphertext=credential.ciphertext)
    with pytest.raises(SecretUnreadable, match="written for another credential"):
        lookup(tenant_b.pk, "tasks")
    credential.set_secret("replaced", actor="test")
    credential.save()
    assert lookup(tenant_a.pk, "tasks").reveal() == "replaced"
    credential.delete()
    assert lookup(tenant_a.pk, "tasks") is None


def test_keys_from_the_environment_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("X_KEYS", raising=False)
    with pytest.raises(EnvError, match="X_KEYS is required when DEBUG is off"):
        env_fernet_keys("X_KEYS")
    derived = env_fernet_keys("X_KEYS", derive_from="dev-secret")
    assert Fernet(derived[0].encode())  # a usable key, the same every time
    assert derived == env_fernet_keys("X_KEYS", derive_from="dev-secret")
    good = Fernet.generate_key().decode()
    monkeypatch.setenv("X_KEYS", f"{good}, not-a-key")
    with pytest.raises(EnvError, match="key #2 is not a Fernet key"):
        env_fernet_keys("X_KEYS")
    monkeypatch.setenv("X_KEYS", good)
    assert env_fernet_keys("X_KEYS") == [good]


def test_production_refuses_to_start_without_secret_keys() -> None:
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    env.update(
        DEBUG="0",
        SECRET_KEY="s" * 60,
        ALLOWED_HOSTS="holdpoint.example.com",
        DJANGO_SETTINGS_MODULE="config.settings",
    )
    result = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "HOLDPOINT_SECRET_KEYS is required when DEBUG is off" in result.stderr


# --- on the wire ------------------------------------------------------------------------


def test_the_tracker_gets_the_tenants_credential_and_refuses_without_it(
    tenant_a: Tenant, tenant_b: Tenant, locked_sandbox: Sandbox
) -> None:
    tool = get_tool("tasks.create")
    run_a = create_run(tenant_a, "api-review", GOAL, actor="t")
    run_b = create_run(tenant_b, "api-review", GOAL, actor="t")
    without = tool.call('{"title":"x"}', key="k0", fence=1, run_id=str(run_a.run_id))
    assert without.outcome == "refused" and "HTTP 401" in without.detail
    store(tenant_a)
    store(tenant_b, "a-wrong-token")
    with_a = tool.call('{"title":"a"}', key="k1", fence=1, run_id=str(run_a.run_id))
    with_b = tool.call('{"title":"b"}', key="k2", fence=1, run_id=str(run_b.run_id))
    assert with_a.outcome == "applied"
    assert with_b.outcome == "refused" and "HTTP 401" in with_b.detail
    assert [t["idempotency_key"] for t in tasks(locked_sandbox)] == ["k1"]
    # Lookups by key carry it too (modes key and lookup).
    assert tool.lookup("k-a", run_id=str(run_a.run_id)).found is False
    assert tool.lookup("k-b", run_id=str(run_b.run_id)).found is None
    # A replaced secret is used from the next call on.
    credential = ToolCredential.objects.get(tenant=tenant_b)
    credential.set_secret(SANDBOX_TOKENS[1])
    credential.save()
    again = tool.call('{"title":"b"}', key="k2", fence=1, run_id=str(run_b.run_id))
    assert again.outcome == "applied"


@pytest.mark.django_db(transaction=True)  # commits of their own: PostgreSQL's one statement
def test_each_action_of_a_worker_carries_the_credential_as_it_is_then(
    tenant_a: Tenant, locked_sandbox: Sandbox
) -> None:
    """A worker's action reads the credential with the action itself (on PostgreSQL its
    prepare statement reads it along): never one kept from an earlier action — a replaced
    secret counts from the next action on, a wrong one is refused by the tracker."""

    def act() -> Action:
        goal = {"tool": "tasks.create", "title": "Rotate the keys"}
        run = create_run(tenant_a, "ticketing-later", goal, actor="user:alice")
        advance_run(run.run_id, "w1")
        return Action.objects.get(run=run)

    credential = store(tenant_a)
    first = act()
    assert first.status == ActionStatus.CONFIRMED, first.last_error
    credential.set_secret("tt-a-token-the-tracker-refuses")
    credential.save()
    refused = act()
    assert refused.status == ActionStatus.FAILED and "HTTP 401" in refused.last_error
    credential.set_secret(SANDBOX_TOKENS[1])
    credential.save()
    third = act()
    assert third.status == ActionStatus.CONFIRMED, third.last_error
    assert [t["id"] for t in tasks(locked_sandbox)] == [first.external_id, third.external_id]


def test_the_plaintext_appears_in_no_log_journal_export_response_or_page(
    tenant_a: Tenant,
    reviewer_a: Persona,
    agent_a: Persona,
    admin_a: Persona,
    locked_sandbox: Sandbox,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    for name in ("httpx", "httpcore", "holdpoint", "django", "runtime"):
        caplog.set_level(logging.DEBUG, logger=name)  # restored after the test
    admin = Client()
    admin.force_login(admin_a.user)
    added = admin.post(
        "/admin/runtime/toolcredential/add/",
        {"tenant": tenant_a.pk, "service": "tasks", "secret": PLAINTEXT},
    )
    assert added.status_code == 302, added.content[:2000]
    assert ToolCredential.objects.get(tenant=tenant_a).secret().reveal() == PLAINTEXT

    # A run that creates a task, with a dropped answer on the way (an exception, then a
    # replay with the same key): the happy path and the error path both log.
    locked_sandbox.faults(drop_after=1)
    run = create_run(tenant_a, "api-review", GOAL, actor="user:alice")
    for _ in range(5):
        advance_run(run.run_id, "w1")
        run.refresh_from_db()
        if run.status == RunStatus.COMPLETED:
            break
        Run.objects.filter(pk=run.pk).update(wake_at=None)
    assert run.status == RunStatus.COMPLETED, run.status
    action = Action.objects.get(run=run)
    assert action.status == ActionStatus.CONFIRMED
    assert [t["id"] for t in tasks(locked_sandbox)] == [action.external_id]
    logged = caplog.text + "\n".join(
        logging.Formatter().format(r) for r in caplog.records if r.exc_info
    )
    assert "HTTP Request: POST" in logged  # the capture saw the calls (httpx's own log)
    assert PLAINTEXT not in logged

    journal = json.dumps(list(JournalEntry.objects.values_list("payload", flat=True)))
    assert "toolcredential" in journal.lower() or "secret" in journal  # the admin change
    assert PLAINTEXT not in journal

    pages = Client()
    pages.force_login(reviewer_a.user)
    exports = [pages.get("/audit/export.csv"), pages.get("/audit/export.jsonl")]
    exported = b"".join(b"".join(r.streaming_content) for r in exports).decode()
    assert str(run.run_id) in exported and PLAINTEXT not in exported

    api = agent_a.api()
    responses = [
        api.get(f"/api/v1/runs/{run.run_id}/"),
        api.get(f"/api/v1/runs/{run.run_id}/events/"),
        api.get(f"/api/v1/runs/{run.run_id}/actions/"),
        api.get(f"/api/v1/actions/{action.action_id}/"),
        APIClient().get("/api/v1/runs/", HTTP_AUTHORIZATION=f"Token {PLAINTEXT}"),  # 401
    ]
    assert [r.status_code for r in responses] == [200, 200, 200, 200, 401]
    assert all(PLAINTEXT.encode() not in r.content for r in responses)

    credential = ToolCredential.objects.get(tenant=tenant_a)
    admin_pages = [
        admin.get("/admin/runtime/toolcredential/"),
        admin.get(f"/admin/runtime/toolcredential/{credential.pk}/change/"),
        admin.get(f"/admin/runtime/toolcredential/{credential.pk}/history/"),
        # A form sent back with an error must not echo the typed secret either.
        admin.post("/admin/runtime/toolcredential/add/", {"tenant": "", "secret": PLAINTEXT}),
    ]
    assert [r.status_code for r in admin_pages] == [200, 200, 200, 200]
    assert all(PLAINTEXT.encode() not in r.content for r in admin_pages)
    assert b"set" in admin_pages[1].content and credential.ciphertext.encode() not in b"".join(
        r.content for r in admin_pages
    )


def test_the_admin_replaces_a_secret_only_when_one_is_typed(
    admin_a: Persona, tenant_a: Tenant, tenant_b: Tenant
) -> None:
    credential = store(tenant_a)
    theirs = store(tenant_b, "b-secret")
    admin = Client()
    admin.force_login(admin_a.user)
    url = f"/admin/runtime/toolcredential/{credential.pk}/change/"
    assert admin.post(url, {"secret": ""}).status_code == 302
    assert ToolCredential.objects.get(pk=credential.pk).secret().reveal() == PLAINTEXT
    assert admin.post(url, {"secret": "replaced-1"}).status_code == 302
    changed = ToolCredential.objects.get(pk=credential.pk)
    assert changed.secret().reveal() == "replaced-1" and changed.updated_by == "user:ada"
    # Another tenant's credential is not there for this admin.
    foreign = admin.get(f"/admin/runtime/toolcredential/{theirs.pk}/change/")
    assert foreign.status_code == 302 and foreign["Location"] == "/admin/"
    assert b"globex" not in admin.get("/admin/runtime/toolcredential/").content


@pytest.mark.django_db
def test_seed_demo_stores_the_sandbox_token_as_the_demo_credential(settings: Any) -> None:
    """`HOLDPOINT_SANDBOX_TOKENS=… make run`: the sandbox requires the first token and the
    demo tenants send it, with no other step."""
    call_command("seed_demo", stdout=StringIO())
    assert not ToolCredential.objects.exists()  # an open sandbox needs none
    settings.HOLDPOINT_SANDBOX_TOKENS = ["demo-tracker-token", "spare"]
    call_command("seed_demo", stdout=StringIO())
    stored = {c.tenant.slug: c for c in ToolCredential.objects.select_related("tenant")}
    assert set(stored) == {"demo", "other"}
    assert stored["demo"].secret().reveal() == "demo-tracker-token"
    call_command("seed_demo", stdout=StringIO())  # again: unchanged
    assert ToolCredential.objects.get(pk=stored["demo"].pk).ciphertext == stored["demo"].ciphertext


def _error_page(request: Any, credential: ToolCredential) -> str:
    """The technical 500 page of an error raised where a decrypted credential is a local."""
    from django.views.debug import ExceptionReporter

    try:
        secret = credential.secret()
        raise RuntimeError(f"the tracker refused {secret}")
    except RuntimeError:
        return ExceptionReporter(request, *sys.exc_info()).get_traceback_html()


def test_a_debug_error_page_shows_no_credential_key_or_token(
    tenant_a: Tenant, agent_a: Persona, rf: Any, settings: Any
) -> None:
    """Django's technical 500 page lists frame locals, settings and request headers: the
    decrypted credential (a masked Secret), HOLDPOINT_SECRET_KEYS and the agent's token in
    the Authorization header are each shown masked."""
    key = str(agent_a.token)
    html = _error_page(rf.get("/api/v1/runs/", HTTP_AUTHORIZATION=f"Token {key}"), store(tenant_a))
    assert "Secret(&#x27;********&#x27;)" in html  # the local is there, masked
    assert "HTTP_AUTHORIZATION" in html and "HOLDPOINT_SECRET_KEYS" in html
    assert PLAINTEXT not in html and key not in html
    assert all(k not in html for k in settings.HOLDPOINT_SECRET_KEYS)
