"""`check_migrations` tells, before a deploy, which parked runs could not resume."""

from __future__ import annotations

from collections.abc import Iterator
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from runtime.executor import advance_run
from runtime.graphs import registry
from runtime.lifecycle import create_run
from runtime.models import Checkpoint, Run, Tenant
from tests.graphs import evolving


@pytest.fixture
def parked(tenant_a: Tenant) -> Iterator[Run]:
    registry.register(evolving("1"))
    run = create_run(tenant_a, "evolving", {}, actor="t")
    advance_run(run.run_id, "w1")  # parked, waiting for input on v1
    registry.unregister("evolving", "1")
    registry.register(evolving("2"))
    yield run
    for version in ("1", "2", "3"):
        registry.unregister("evolving", version)
    registry.migrations.clear()


def _check() -> tuple[str, bool]:
    out = StringIO()
    try:
        call_command("check_migrations", stdout=out)
    except CommandError:
        return out.getvalue(), False
    return out.getvalue(), True


def test_reports_a_run_without_migration(parked: Run) -> None:
    text, ok = _check()
    assert not ok
    assert f"FAIL {parked.run_id} evolving@1: not registered" in text


def test_reports_a_migration_that_raises_and_writes_nothing(parked: Run) -> None:
    def broken(state: dict) -> dict:
        raise KeyError("shape")

    registry.register_migration("evolving", "1", "2", broken)
    before = Checkpoint.objects.filter(run=parked).count()
    text, ok = _check()
    assert not ok and "migration raised KeyError" in text
    assert Checkpoint.objects.filter(run=parked).count() == before
    assert Run.objects.get(pk=parked.pk).graph_version == "1"


def test_a_good_migration_passes(parked: Run) -> None:
    registry.register_migration("evolving", "1", "2", lambda s: {**s, "shape": "2"})
    text, ok = _check()
    assert ok and "would migrate 1 → 2" in text and "1 unfinished run(s) checked, 0" in text
