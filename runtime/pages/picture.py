"""The run as a picture: the graph's steps with the current one marked, and a flow of what
happened in each step visit (recorded calls, actions, decisions), each with its duration.

Computed from the run's journal alone (the same entries the audit timeline lists), so the
picture can never say something the journal does not. Rendered on every live poll of the
run page: the reads are bounded (`FLOW_LIMIT`, `VISIT_LIMIT`) and fetch no more than they
show.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import QuerySet
from django.db.models.fields.json import KT
from django.utils import timezone

from audit.models import JournalEntry
from runtime.events import RunEvent
from runtime.graphs import registry
from runtime.models import Run, RunStatus

# Newest entries the flow draws per poll; the step counts read only step commits (cheap rows).
FLOW_LIMIT = 300
VISIT_LIMIT = 5000
EXTERNAL_STEP = "api"

FLOW_TYPES = (
    RunEvent.CREATED,
    RunEvent.STEP_COMMITTED,
    RunEvent.CALL_RECORDED,
    RunEvent.ACTION_PREPARED,
    RunEvent.ACTION_OUTCOME,
    RunEvent.ACTION_CANCELLED,
    RunEvent.APPROVAL_REQUESTED,
    RunEvent.APPROVAL_DECIDED,
    RunEvent.APPROVAL_CLOSED,
    RunEvent.PARKED,
    RunEvent.STEP_FAILED,
    RunEvent.CANCELLED,
)

SETTLED = frozenset({"confirmed", "failed", "cancelled", "compensated", "manual_review"})

DECIDED = {"approve": "approved", "reject": "rejected"}

# The run's status as the Steps panel says it next to the current step.
STATUS_WORDS: dict[str, str] = {
    RunStatus.QUEUED: "queued",
    RunStatus.RUNNING: "running",
    RunStatus.WAITING_INPUT: "waiting for input",
    RunStatus.WAITING_APPROVAL: "waiting for approval",
    RunStatus.RETRYING: "retrying after a failure",
    RunStatus.NEEDS_RECONCILIATION: "waiting for reconciliation",
    RunStatus.NEEDS_ATTENTION: "needs attention",
}


def duration_words(delta: timedelta | None) -> str:
    """A duration as a person reads it: "0.4 s", "12 s", "3 min 5 s", "2 h 10 min"."""
    if delta is None:
        return ""
    seconds = max(delta.total_seconds(), 0.0)
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s" if secs else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    return f"{hours // 24} d {hours % 24} h"


# --- the Steps panel --------------------------------------------------------------------


@dataclass(frozen=True)
class StepRow:
    """One step of the graph as the Steps panel shows it."""

    name: str
    mark: str  # "done" | "current" | "not-reached"
    mark_words: str  # what a reader sees: "done", "current — waiting for approval", …
    visits: int
    duration: str
    start: bool = False


def step_names(run: Run) -> tuple[list[str], str]:
    """The graph's steps in the order it declares them, and its start step. An external run
    (or one whose graph version is no longer registered) is drawn as its one step `api`."""
    if run.external:
        return [EXTERNAL_STEP], EXTERNAL_STEP
    graph = registry.get(run.graph, run.graph_version)
    if graph is None:
        return [], ""
    return list(graph.steps), graph.start


def _commits(journal: QuerySet[JournalEntry]) -> list[tuple[str, datetime | None]]:
    """(step, committed at) of the run's step commits, oldest first (bounded); None: a time
    that cannot be read (audit.models.JournalTime)."""
    rows = (
        journal.filter(type=RunEvent.STEP_COMMITTED)
        .order_by("-seq")
        # As text: a plain `payload__step` is decoded as JSON on SQLite, so a step named
        # "true", "null" or "1e2" came back as True, None or 100.0.
        .values_list(KT("payload__step"), "created_at")[:VISIT_LIMIT]
    )
    return [(str(step or ""), at) for step, at in reversed(list(rows))]


def steps_panel(
    run: Run, journal: QuerySet[JournalEntry], now: datetime | None = None
) -> list[StepRow]:
    """Each step: done / current / not reached, how often it was visited and for how long in
    all. A visit lasts from the previous step commit (or the run's creation) to its own
    commit; the current visit counts up to now."""
    now = now or timezone.now()
    names, start = step_names(run)
    commits = _commits(journal)
    visits: dict[str, int] = {}
    spent: dict[str, timedelta] = {}
    begun = run.created_at
    for step, committed in commits:
        at = committed or begun  # unreadable (edited; the trail names it): no time spent
        name = EXTERNAL_STEP if run.external else step
        visits[name] = visits.get(name, 0) + 1
        spent[name] = spent.get(name, timedelta()) + (at - begun)
        begun = at
    current = ""
    if not run.is_terminal:
        current = EXTERNAL_STEP if run.external else run.next_step
    if current:
        # An external run's visits are its checkpoints; a graph step's current visit counts.
        visits[current] = visits.get(current, 0) + (0 if run.external else 1)
        spent[current] = spent.get(current, timedelta()) + (now - begun)
    for name in visits:  # steps the run visited that this graph version no longer has
        if name and name not in names:
            names.append(name)
    rows = []
    for name in names:
        if name == current:
            mark, words = "current", "current — " + STATUS_WORDS.get(run.status, run.status)
        elif visits.get(name) or name in spent:
            mark, words = "done", "done"
        else:
            mark, words = "not-reached", "not reached"
        rows.append(
            StepRow(
                name=name,
                mark=mark,
                mark_words=words,
                visits=visits.get(name, 0),
                duration=duration_words(spent.get(name)),
                start=name == start,
            )
        )
    return rows


# --- the Flow view ----------------------------------------------------------------------


@dataclass
class FlowItem:
    """One thing inside a step visit: a recorded call, an action, a decision."""

    lane: str  # "call" | "action" | "decision" | "event"
    title: str
    detail: str
    at: datetime
    ended: datetime | None = None
    open: bool = False  # still going (an action not settled, a request not decided)
    duration: str = ""


@dataclass
class Visit:
    """One visit of a step, from its start to its commit (or still open)."""

    step: str
    started: datetime
    ended: datetime | None = None
    outcome: str = ""
    items: list[FlowItem] = field(default_factory=list)
    duration: str = ""

    @property
    def open(self) -> bool:
        return self.ended is None


def _entries(journal: QuerySet[JournalEntry]) -> list[JournalEntry]:
    rows = (
        journal.filter(type__in=[t.value for t in FLOW_TYPES])
        .only("seq", "type", "payload", "created_at")
        .order_by("-seq")[:FLOW_LIMIT]
    )
    return list(reversed(list(rows)))


def flow(run: Run, journal: QuerySet[JournalEntry], now: datetime | None = None) -> list[Visit]:
    """The step visits in order, each with its calls, actions and decisions. A call lasts to
    the next entry of the same visit; an action from prepared to its last outcome; a decision
    from requested to decided or closed undecided (or until now while pending)."""
    now = now or timezone.now()
    visits: list[Visit] = []
    visit = Visit(step="", started=run.created_at)
    actions: dict[str, FlowItem] = {}
    approvals: dict[str, FlowItem] = {}
    last_call: FlowItem | None = None
    at = run.created_at
    for entry in _entries(journal):
        payload: dict[str, Any] = entry.payload if isinstance(entry.payload, dict) else {}
        kind = entry.type
        # A time that cannot be read (edited; the trail names it) counts as the one before.
        at = entry.created_at or at
        if last_call is not None and last_call.ended is None:
            last_call.ended = at
        last_call = None
        if kind == RunEvent.CREATED:
            visit.started = at
        elif kind == RunEvent.STEP_COMMITTED:
            visit.step = EXTERNAL_STEP if run.external else str(payload.get("step", ""))
            visit.ended = at
            visit.outcome = _commit_words(payload)
            visits.append(visit)
            visit = Visit(step="", started=at)
        elif kind == RunEvent.CANCELLED:
            # No step commit ends a cancelled run's last visit: its cancellation does, or the
            # visit (its calls, its withdrawn action and request) would vanish from the Flow.
            visit.step = EXTERNAL_STEP if run.external else run.next_step
            visit.ended, visit.outcome = at, "cancelled the run"
            visits.append(visit)
            visit = Visit(step="", started=at)
        elif kind == RunEvent.CALL_RECORDED:
            last_call = FlowItem("call", "recorded call", str(payload.get("key", "")), at)
            visit.items.append(last_call)
        elif kind == RunEvent.ACTION_PREPARED:
            item = FlowItem(
                "action",
                f"action {payload.get('tool', '')}",
                str(payload.get("action_status", "prepared")),
                at,
                open=True,
            )
            actions[str(payload.get("action_id", ""))] = item
            visit.items.append(item)
        elif kind in (RunEvent.ACTION_OUTCOME, RunEvent.ACTION_CANCELLED):
            found = actions.get(str(payload.get("action_id", "")))
            status = str(payload.get("action_status", "cancelled"))
            if found is not None:
                found.detail += f" → {status}"
                found.ended = at
                found.open = status not in SETTLED
        elif kind == RunEvent.APPROVAL_REQUESTED:
            item = FlowItem(
                "decision",
                "approval requested",
                f"policy {payload.get('policy', '')}",
                at,
                open=True,
            )
            approvals[str(payload.get("approval_id", ""))] = item
            visit.items.append(item)
        elif kind == RunEvent.APPROVAL_DECIDED:
            found = approvals.get(str(payload.get("approval_id", "")))
            decision = str(payload.get("decision", ""))
            if found is not None:
                final = bool(payload.get("final", True))
                found.title = (
                    f"approval {DECIDED.get(decision, decision)}" if final else found.title
                )
                found.detail += f" · {decision} by {entry.actor}"
                if final:
                    found.ended, found.open = at, False
        elif kind == RunEvent.APPROVAL_CLOSED:
            found = approvals.get(str(payload.get("approval_id", "")))
            if found is not None:
                _close(found, payload, entry.actor, at)
        elif kind in (RunEvent.PARKED, RunEvent.STEP_FAILED):
            words = "parked" if kind == RunEvent.PARKED else "step failed"
            reason = str(payload.get("reason", "") or payload.get("error", ""))
            visit.items.append(FlowItem("event", words, reason[:200], at))
    if not run.is_terminal:
        visit.step = EXTERNAL_STEP if run.external else run.next_step
        visits.append(visit)
    for v in visits:
        v.duration = duration_words((v.ended or now) - v.started)
        for item in v.items:
            if item.lane == "event":
                continue
            end = item.ended if item.ended is not None else (now if item.open else None)
            item.duration = duration_words(end - item.at) if end is not None else ""
    return visits


def _close(item: FlowItem, payload: dict[str, Any], actor: str, at: datetime) -> None:
    """A request that ended undecided (approvals.requests.close_request: expired, superseded,
    cancelled) ends its item there, or it would read as still requested for ever. One already
    decided (an approval superseded at dispatch) keeps its decision's end: the wait it shows
    was the reviewers', and the title says what became of it; the dispatch re-check's words
    say why (an expiry: when, and that it was asked again), not which worker found it."""
    status = str(payload.get("approval_status", "")) or "closed"
    reason = str(payload.get("reason", ""))[:200]
    if item.open:
        item.detail += f" · {status} by {actor}" + (f": {reason}" if reason else "")
        item.title = f"approval {status}"
        item.ended, item.open = at, False
    else:
        item.detail += f" · {status}: {reason}" if reason else f" · {status} by {actor}"
        item.title += f", then {status}"


def _commit_words(payload: dict[str, Any]) -> str:
    status = str(payload.get("status", ""))
    nxt = str(payload.get("next_step", ""))
    if status == RunStatus.COMPLETED:
        return "completed the run"
    if status == RunStatus.FAILED:
        return "failed the run"
    if nxt:
        return f"→ {nxt}" + (
            f" ({STATUS_WORDS.get(status, status)})" if status != "running" else ""
        )
    return STATUS_WORDS.get(status, status)


def picture_context(run: Run, journal: QuerySet[JournalEntry]) -> dict[str, Any]:
    """What the run page's Steps and Flow panels render."""
    now = timezone.now()
    return {"steps": steps_panel(run, journal, now), "flow": flow(run, journal, now)}
