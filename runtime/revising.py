"""What a worker does when the run it takes up changed while nobody executed it: the graph
version it is pinned to is gone (its state is migrated to a registered version), or its goal
was revised (the new version's revision hook decides what of the state is still valid
evidence, and where to continue). Each is one commit of the executor's (runtime.executor),
journalled as `migrated` / `revision_applied`; a hook or a migration that fails escalates the
run instead of half-applying.
"""

from __future__ import annotations

from typing import Any, Protocol

from audit import journal
from audit.canonical import digest
from audit.models import JournalEntry
from fastsql import statements
from runtime.artifacts import Encoder
from runtime.errors import StaleFence
from runtime.events import RunEvent
from runtime.graphs import Graph, Migration, Next, registry, unstorable
from runtime.models import Run, RunStatus


class Host(Protocol):
    """What these need of the executor: the run it holds, its state and the goal revision that
    state belongs to, its encoder, and its commit and escalation (runtime.executor)."""

    run: Run
    state: dict[str, Any]
    state_goal_rev: int
    encoder: Encoder

    def load(self) -> None: ...

    def escalate(self, reason: str, event: RunEvent = RunEvent.ESCALATED) -> None: ...

    def commit(
        self,
        step: str,
        state: dict[str, Any],
        status: str,
        next_step: str,
        changes: dict[str, Any],
        event: RunEvent,
        *,
        state_goal_rev: int | None = None,
        **payload: Any,
    ) -> bool: ...


def compatible_graph(host: Host) -> Graph | None:
    """The run's graph: its pinned version, or the registered migration's target once the
    migration is committed. None if the run cannot go on (escalated, or it stopped)."""
    run = host.run
    graph = registry.get(run.graph, run.graph_version)
    if graph is not None:
        return graph
    path = registry.migration_path(run.graph, run.graph_version)
    if not path:
        host.escalate(
            f"graph {run.graph} version {run.graph_version} is not registered and no "
            "registered migration leads from it to a registered version",
            RunEvent.INCOMPATIBLE,
        )
        return None
    # A goal revised between the read and the commit refuses the commit (its CAS names the
    # goal_rev) but leaves the run running under our fence: an ordinary move, so read the
    # checkpoint again and migrate it again. Anything else that moved it stopped it.
    while not migrate(host, path):
        if host.run.status != RunStatus.RUNNING:
            return None
    graph = registry.get(run.graph, host.run.graph_version)
    assert graph is not None  # the path ends at a registered version
    return graph


def migrate(host: Host, path: list[tuple[str, str, Migration]]) -> bool:
    """Commit the last checkpoint's state migrated along `path`, still stamped with the
    goal_rev that state belongs to: a migration changes its shape, not its goal, so a revision
    made before it is still applied after it (by the revision hook of the new version). True
    if committed; False if the run moved or the migration failed (then the run is
    escalated)."""
    host.load()
    state, before = host.state, digest(host.encoder.encode(host.state))
    host.encoder.new = {}
    try:
        for _, _, step in path:
            state = step(dict(state))
        after = digest(host.encoder.encode(state))  # refuses a state that is not JSON
    except Exception as exc:  # a failing migration must not half-apply
        host.escalate(
            f"migration from {host.run.graph_version} failed: {unstorable(Next('', state), exc)}",
            RunEvent.INCOMPATIBLE,
        )
        return False
    source, target = host.run.graph_version, path[-1][1]
    host.encoder.new = {}
    ok = host.commit(
        "(migration)",
        state,
        RunStatus.RUNNING,
        host.run.next_step,
        {"graph_version": target},
        RunEvent.MIGRATED,
        state_goal_rev=host.state_goal_rev,
        from_version=source,
        to_version=target,
        before_digest=before,
        after_digest=after,
    )
    if ok:
        host.run.graph_version = target
    return ok


def apply_revision(host: Host, graph: Graph) -> bool:
    """Let the graph keep the evidence still valid for the new goal; continue from there.
    False if the run cannot go on (the hook failed: escalated; or the run stopped)."""
    old_goal = goal_at(host.run, host.state_goal_rev)
    state: dict[str, Any] = {}
    try:
        state, next_step = graph.revise(dict(host.state), old_goal, host.run.goal)
        applied = host.commit(
            "(revision)",
            state,
            RunStatus.RUNNING,
            next_step,
            {},
            RunEvent.REVISION_APPLIED,
            from_rev=host.state_goal_rev,
            to_rev=host.run.goal_rev,
            kept=sorted(state),
        )
    except StaleFence:
        raise
    except Exception as exc:  # the hook, or a kept state that cannot be stored
        host.escalate(f"revision hook failed: {unstorable(Next('', state), exc)}")
        return False
    return applied or host.run.status == RunStatus.RUNNING


def goal_at(run: Run, goal_rev: int) -> Any:
    """The goal as it was at `goal_rev`, from the journal's revision events."""
    revisions = JournalEntry.objects.filter(
        statements.tenant_check(run.tenant_id),
        stream=journal.run_stream(run.run_id),
        type=RunEvent.GOAL_REVISED.value,
    ).order_by("seq")
    for entry in revisions:
        if entry.payload.get("from_rev") == goal_rev:
            return entry.payload.get("previous_goal")
    return run.goal
