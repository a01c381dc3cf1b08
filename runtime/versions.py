"""Dry-running graph migrations over parked runs, before a deploy rather than after."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from runtime.artifacts import resolve
from runtime.graphs import registry
from runtime.ledger import visit_actions
from runtime.models import TERMINAL, ActionStatus, Checkpoint, Run

# An action in one of these has an outcome nobody needs to wait for: a step that runs again
# gets its proof (or its refusal) back. Any other status is an action in the middle.
SETTLED = frozenset(
    {
        ActionStatus.CONFIRMED,
        ActionStatus.FAILED,
        ActionStatus.CANCELLED,
        ActionStatus.COMPENSATED,
    }
)


@dataclass(frozen=True)
class Verdict:
    run_id: str
    graph: str
    version: str
    ok: bool
    detail: str
    # The unsettled actions of the step visit the migration lands in ("tasks.create sent"):
    # the migrated step must ask for the same calls with the same params to find them.
    mid_action: tuple[str, ...] = ()


def check_run(run: Run) -> Verdict:
    """What resuming this run on the registered graphs would do, without writing anything."""

    def verdict(ok: bool, detail: str, mid_action: tuple[str, ...] = ()) -> Verdict:
        return Verdict(str(run.run_id), run.graph, run.graph_version, ok, detail, mid_action)

    if registry.get(run.graph, run.graph_version) is not None:
        return verdict(True, "pinned version is registered")
    path = registry.migration_path(run.graph, run.graph_version)
    if not path:
        return verdict(False, "not registered and no migration leads to a registered version")
    state = {}
    if run.checkpoint_rev:
        checkpoint = Checkpoint.objects.get(run=run, rev=run.checkpoint_rev)
        state = resolve(run.tenant_id, checkpoint.state)
    try:
        for _, _, migrate in path:
            state = migrate(dict(state))
    except Exception as exc:  # report, never raise: the point is a full list
        return verdict(False, f"migration raised {type(exc).__name__}: {exc}")
    target = registry.get(run.graph, path[-1][1])
    assert target is not None
    if run.next_step and run.next_step not in target.steps:
        return verdict(False, f"version {target.version} has no step {run.next_step!r}")
    chain = " → ".join([run.graph_version] + [to for _, to, _ in path])
    pending = unsettled_in_visit(run)
    if pending:
        return verdict(
            True,
            f"would migrate {chain}, landing mid-action in step {run.next_step!r} "
            f"({', '.join(pending)}): version {target.version}'s step must ask for the "
            "same call(s) with the same params",
            pending,
        )
    return verdict(True, f"would migrate {chain}")


def unsettled_in_visit(run: Run) -> tuple[str, ...]:
    """The actions of the run's current step visit whose outcome is not settled, as
    "call 1: tasks.create sent" — what a migration keeps in the middle (the visit is kept,
    so the migrated step finds them by their keys)."""
    if not run.next_step:
        return ()
    calls = visit_actions(run, run.next_step)
    return tuple(
        f"call {index}: {action.tool} {action.status}"
        for index, action in sorted(calls.items())
        if action.status not in SETTLED
    )


def parked_runs(tenant_slug: str | None = None) -> Iterator[Run]:
    runs = Run.objects.exclude(status__in=TERMINAL).order_by("created_at")
    if tenant_slug:
        runs = runs.filter(tenant__slug=tenant_slug)
    return runs.iterator()
