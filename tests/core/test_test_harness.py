"""The suite's shortcuts give the answers of what they stand in for: a port is asked whether
it accepts before the kernel's table is read (tests/procs.py), httpx clients share a TLS
context only where they asked for the default one (tests/httpx_tls.py), and the flush after a
transactional test leaves the database as Django's would (tests/kept_tables.py)."""

from __future__ import annotations

import socket

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command

from runtime.models import Tenant
from tests import procs


def test_accepting_tells_a_listening_port_from_a_free_one() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        assert procs.accepting(listener.getsockname()[1])
    assert not procs.accepting(procs.free_port())


def test_httpx_clients_share_the_default_tls_context_and_keep_their_own() -> None:
    def context(client: httpx.Client) -> object:
        return client._transport._pool._ssl_context  # type: ignore[attr-defined]

    with httpx.Client() as one, httpx.Client() as two, httpx.Client(verify=False) as lax:
        assert context(one) is context(two)
        assert context(lax) is not context(one)
        assert context(one).verify_mode.name == "CERT_REQUIRED"  # type: ignore[attr-defined]
        assert context(lax).verify_mode.name == "CERT_NONE"  # type: ignore[attr-defined]


@pytest.mark.django_db(transaction=True)
def test_the_flush_empties_every_table_but_keeps_the_rows_post_migrate_makes() -> None:
    kinds = dict(ContentType.objects.values_list("pk", "model"))
    permissions = dict(Permission.objects.values_list("pk", "codename"))
    Tenant.objects.create(name="gone", slug="gone")
    get_user_model().objects.create_user("gone")
    assert kinds and permissions

    call_command("flush", interactive=False, verbosity=0)

    assert not Tenant.objects.exists()
    assert not get_user_model().objects.filter(username="gone").exists()
    assert dict(ContentType.objects.values_list("pk", "model")) == kinds
    assert dict(Permission.objects.values_list("pk", "codename")) == permissions
