"""The suite's shortcuts give the answers of what they stand in for: a process forked from the
zygote is the process `python manage.py …` would be (tests/zygote.py), a port is asked whether
it accepts before the kernel's table is read (tests/procs.py), httpx clients share a TLS
context only where they asked for the default one (tests/httpx_tls.py), and the flush after a
transactional test leaves the database as Django's would (tests/kept_tables.py)."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command
from django.db import connection

from runtime.models import Tenant
from tests import procs, zygote

PROBE = (
    "import os, sys; from django.conf import settings; "
    "import __main__; print('argv', sys.argv[0]); print('file', __main__.__file__); "
    "print('marker', os.environ.get('ZYGOTE_PROBE')); "
    "print('database', settings.DATABASES['default']['NAME']); "
    "print('session', os.getsid(0) == os.getpid()); "
    "sys.exit(int(os.environ['ZYGOTE_EXIT']))"
)


@pytest.mark.django_db
@pytest.mark.skipif(not zygote.enabled(), reason="HOLDPOINT_TEST_ZYGOTE=0: processes start fresh")
@pytest.mark.parametrize("code", [0, 3])
def test_a_forked_process_answers_as_a_fresh_one_with_its_own_environment(
    code: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = procs.child_env(ZYGOTE_PROBE=f"probe-{code}", ZYGOTE_EXIT=str(code))
    seen = {}
    for way in ("1", "0"):
        monkeypatch.setenv("HOLDPOINT_TEST_ZYGOTE", way)
        log = tmp_path / f"probe-{way}.log"
        child = procs.start(["shell", "--no-imports", "-c", PROBE], env, log)
        assert isinstance(child, zygote.Started) == (way == "1")
        assert child.wait(timeout=60) == code
        seen[way] = log.read_text().splitlines()
    # settings made in the child from its environment; a session of its own; manage.py run
    # as python runs a script — line for line what the fresh interpreter printed
    assert (
        seen["1"]
        == seen["0"]
        == [
            "argv manage.py",
            f"file {procs.ROOT / 'manage.py'}",
            f"marker probe-{code}",
            f"database {connection.settings_dict['NAME']}",  # the test's, from DATABASE_URL
            "session True",
        ]
    )


@pytest.mark.django_db
@pytest.mark.skipif(not zygote.enabled(), reason="HOLDPOINT_TEST_ZYGOTE=0: processes start fresh")
def test_a_forked_process_killed_with_its_group_reads_as_killed(tmp_path: Path) -> None:
    child = procs.start(
        ["shell", "--no-imports", "-c", "import time; print('up', flush=True); time.sleep(120)"],
        procs.child_env(),
        tmp_path / "sleep.log",
    )
    log = tmp_path / "sleep.log"
    procs.wait_for(lambda: log.exists() and "up" in log.read_text(), timeout=60)
    assert child.poll() is None
    procs.kill(child)
    assert child.returncode == -signal.SIGKILL and child.poll() == -signal.SIGKILL


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
