"""The fast path's statements answer as the ORM would, and its one-statement form is all or
nothing. (Its cost and its use on the hot path: tests/runtime/test_perf_invariants.py.)"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection, transaction
from django.db.models import Q
from django.db.models.functions import Now
from django.utils import timezone

from fastsql import statements
from runtime.lifecycle import create_run
from runtime.models import Artifact, Run, Tenant

pytestmark = pytest.mark.django_db


def _run(tenant: Tenant, **times: object) -> Run:
    run = create_run(tenant, "chain", {}, actor="t")
    Run.objects.filter(pk=run.pk).update(**times)
    return run


def _elapsed(run: Run) -> list[bool]:
    (row,) = statements.select(
        Run,
        (statements.Elapsed("lease_expires_at"), statements.Elapsed("wake_at", inclusive=True)),
        {"run_id": run.run_id},
    )
    return row


@pytest.mark.parametrize("offset", [None, -3600, 3600])
def test_elapsed_is_the_database_clocks_verdict_as_the_orm_gives_it(
    tenant_a: Tenant, offset: int | None
) -> None:
    when = None if offset is None else timezone.now() + timedelta(seconds=offset)
    # A lease's owner and expiry are set together (runtime_run_lease_both_or_neither).
    run = _run(
        tenant_a, lease_owner="" if when is None else "w", lease_expires_at=when, wake_at=when
    )
    orm = Run.objects.filter(pk=run.pk)
    expected = [
        orm.filter(Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=Now())).exists(),
        orm.filter(Q(wake_at__isnull=True) | Q(wake_at__lte=Now())).exists(),
    ]
    assert _elapsed(run) == expected == [offset != 3600] * 2


def test_select_orders_both_ways_and_limits_as_the_orm_does(tenant_a: Tenant) -> None:
    for n in (2, 0, 1):
        Artifact.objects.create(tenant=tenant_a, digest=f"{n:064d}", content="x" * n, size=n)
    mine = {"tenant_id": tenant_a.pk}
    orm = Artifact.objects.filter(tenant=tenant_a)
    down = statements.select(Artifact, ("digest", "size"), mine, order_by=("-size",))
    assert down == [list(r) for r in orm.order_by("-size").values_list("digest", "size")]
    top = statements.select(Artifact, ("size",), mine, order_by=("-size", "digest"), limit=1)
    assert top == [[2]]
    assert statements.select(Artifact, ("size",), mine, order_by=("size",), limit=2) == [[0], [1]]


def test_insert_returns_the_new_ids_in_order(tenant_a: Tenant) -> None:
    rows = [
        {"tenant_id": tenant_a.pk, "digest": f"{n:064d}", "content": "x", "size": 1}
        for n in range(3)
    ]
    with transaction.atomic():
        ids = statements.insert(Artifact, rows, pks=True)
    stored = Artifact.objects.filter(tenant=tenant_a).order_by("digest")
    assert ids == [a.pk for a in stored] and len(set(ids)) == 3
    assert all(a.created_at is not None for a in stored)  # auto_now_add, as the ORM sets it
    with transaction.atomic():
        assert statements.insert(Artifact, [{**rows[0], "digest": "f" * 64}]) == []


def test_insert_writes_the_database_clock_and_returns_what_it_stored(tenant_a: Tenant) -> None:
    """A `DbNow` value in an insert is the database's clock (leases and in-flight windows are
    database time), and `returning` gives back what was stored, converted as a read is. The
    Python clock is moved to 2001 meanwhile: only the database's can give today."""
    import time_machine

    row = {"tenant_id": tenant_a.pk, "digest": "c" * 64, "content": "x", "size": 1}
    today = timezone.now()
    with time_machine.travel(datetime(2001, 1, 1, tzinfo=UTC)), transaction.atomic():
        (stored,) = statements.insert(
            Artifact, [{**row, "created_at": statements.DbNow(3600)}], returning=("created_at",)
        )
        plain = [  # the statement text is cached: the second of a shape returns its row too
            statements.insert(Artifact, [{**row, "digest": d * 64}], returning=("size",))
            for d in "de"
        ]
        ids = [statements.insert(Artifact, [{**row, "digest": d * 64}], pks=True) for d in "fg"]
    assert abs(stored[0] - today - timedelta(hours=1)) < timedelta(seconds=30)
    assert Artifact.objects.get(digest="c" * 64).created_at == stored[0]
    assert plain == [[[1]], [[1]]]
    assert [i for (i,) in ids] == [Artifact.objects.get(digest=d * 64).pk for d in "fg"]
    with pytest.raises(ValueError):
        statements.insert(Artifact, [row, row], returning=("size",))


def test_update_then_insert_rows_inserts_only_when_the_update_changed_one_row(
    tenant_a: Tenant,
) -> None:
    run = _run(tenant_a)
    row = {"tenant_id": tenant_a.pk, "digest": "a" * 64, "content": "x", "size": 1}
    mine = {"run_id": run.run_id, "tenant_id": statements.Check(tenant_a.pk), "fence": 0}
    with transaction.atomic():
        ids = statements.update_then_insert_rows(Run, {"fence": 1}, mine, Artifact, [row])
    assert ids == [Artifact.objects.get(digest="a" * 64).pk]
    with transaction.atomic():  # the fence moved: the compare-and-swap refuses
        refused = statements.update_then_insert_rows(
            Run, {"fence": 2}, mine, Artifact, [{**row, "digest": "b" * 64}]
        )
    assert refused is None and not Artifact.objects.filter(digest="b" * 64).exists()
    assert Run.objects.get(pk=run.pk).fence == 1


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_one_statement_writes_every_part_or_none(tenant_a: Tenant) -> None:
    """The last part depends on a part that finds nothing: the first part's change is rolled
    back with the rest — the statement fails on purpose rather than half-apply. (Each part
    its own table, as the journal's are: one statement cannot change a row twice.)"""
    if connection.vendor != "postgresql":
        pytest.skip("one-statement writes are PostgreSQL's")
    run = _run(tenant_a)
    key = {"run_id": run.run_id, "tenant_id": statements.Check(tenant_a.pk)}

    def run_parts(fence: int, gate: str) -> tuple[int, int] | None:
        one = statements.OneStatement()
        tenant = {"id": tenant_a.pk, "slug": gate}
        return one.run(
            [
                one.update("swapped", Run, {"fence": fence + 1}, {**key, "fence": fence}),
                one.lock("gate", Tenant, tenant, after=("swapped",)),
                one.update("marked", Tenant, {"name": f"f{fence + 1}"}, tenant, after=("gate",)),
            ]
        )

    assert run_parts(0, gate="no such tenant") is None
    assert Run.objects.get(pk=run.pk).fence == 0  # the swap was rolled back too
    assert run_parts(5, gate=tenant_a.slug) == (0, 0)  # the swap refused: nothing written
    assert Tenant.objects.get(pk=tenant_a.pk).name == tenant_a.name
    assert run_parts(0, gate=tenant_a.slug) == (1, 1)
    assert Run.objects.get(pk=run.pk).fence == 1
    assert Tenant.objects.get(pk=tenant_a.pk).name == "f1"
    with pytest.raises(RuntimeError), transaction.atomic():
        run_parts(1, gate=tenant_a.slug)  # never inside a transaction


def test_built_is_the_instance_the_model_would_build_and_saves_as_it_would(
    tenant_a: Tenant,
) -> None:
    values = {
        "id": None,
        "tenant_id": tenant_a.pk,
        "digest": "d" * 64,
        "content": "x",
        "size": 1,
        "created_at": timezone.now(),
    }
    assert set(values) == set(statements.attnames(Artifact))
    built = statements.built(Artifact, values)
    usual = Artifact(**values)
    assert {n: getattr(built, n) for n in values} == {n: getattr(usual, n) for n in values}
    assert built._state.adding and built._state.db is None
    built.save()  # a whole instance: nothing left to load, nothing refused
    assert Artifact.objects.get(pk=built.pk).content == "x"


def test_built_gives_a_column_left_out_its_default_and_refuses_a_name_that_is_no_column() -> None:
    from runtime.models import Action

    values = {"tenant_id": 1, "tool": "t", "params": "{}", "created_at": timezone.now()}
    built, usual = statements.built(Action, values), Action(**values)
    columns = statements.attnames(Action)
    assert built.action_id != usual.action_id  # each a fresh uuid4, as the default makes
    assert {n: getattr(built, n) for n in columns if n != "action_id"} == {
        n: getattr(usual, n) for n in columns if n != "action_id"
    }
    assert built.status == "prepared" and built.attempts == 0 and built.result is None
    with pytest.raises(TypeError, match="sizes"):
        statements.built(Artifact, {"digest": "d", "sizes": 1})


def test_built_runs_init_when_something_listens_to_the_models_signals() -> None:
    from django.db.models.signals import post_init

    seen: list[object] = []

    def listener(sender: object, instance: object, **kwargs: object) -> None:
        seen.append(instance)

    values = {n: None for n in statements.attnames(Artifact)}
    post_init.connect(listener, sender=Artifact)
    try:
        built = statements.built(Artifact, values)
    finally:
        post_init.disconnect(listener, sender=Artifact)
    assert seen == [built]
