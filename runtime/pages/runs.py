"""Reviewer pages for runs: the list, starting one, one run's story, and the human levers.

The views translate HTTP into calls of `runtime.lifecycle` and back (`reviewer_page` in
`runtime.pages.access` has already checked who is asking). They never decide
whether a transition is allowed: the lifecycle function's compare-and-swap does, and its
refusal (a HoldpointError) becomes a message on the page rather than a 500. Every read goes
through the tenancy helpers, so another tenant's run is a 404 exactly like a run that does
not exist (DESIGN.md, invariant 9).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlencode
from uuid import UUID

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db.models import Exists, OuterRef, QuerySet, Subquery
from django.http import HttpRequest, HttpResponse, QueryDict
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.cache import patch_vary_headers
from rest_framework import serializers

from audit.canonical import CanonicalError, parse_strict
from audit.journal import run_stream
from audit.verification import Break, verify_stream
from runtime.api.filters import RunFilter, narrowed
from runtime.api.serializers import CancelIn, RunCreate, StrictChar
from runtime.artifacts import resolve
from runtime.compensation import ENDED_UNSENT, REASON_MAX, compensate, send_again
from runtime.errors import HoldpointError, InvalidParams, UnknownGraph
from runtime.graphs import registry
from runtime.lifecycle import (
    RESUMABLE,
    cancel_run,
    create_run,
    provide_input,
    resume_run,
    revise_goal,
)
from runtime.models import SENDABLE, Action, ActionStatus, Membership, Role, Run, RunStatus
from runtime.pages.access import (
    HtmxHttpRequest,
    page_input,
    require_may_act,
    reviewer_page,
    scoped_or_404,
)
from runtime.pages.display import pretty, timeline_row
from runtime.pages.picture import picture_context
from runtime.protocol import name_executor
from runtime.tenancy import (
    Principal,
    actions_for,
    checkpoints_for,
    journal_for,
    runs_for,
)
from runtime.tools import tool_of

PAGE_SIZE = 50
# A long run's page is re-rendered every 2 s while it is live: bound what one poll renders.
TIMELINE_LIMIT = 100
ACTION_LIMIT = 50
DEFAULT_GRAPH = "api-review"
# The list renders only these, so a large goal or state is never loaded for a list row.
LIST_FIELDS = (
    "run_id",
    "status",
    "graph",
    "graph_version",
    "thread_id",
    "goal_rev",
    "checkpoint_rev",
    "next_step",
    "created_at",
    "updated_at",
)


# --- access -----------------------------------------------------------------------------


def scoped_run(principal: Principal, run_id: UUID) -> Run:
    """The run if it is the principal's tenant's; any other case is the same plain 404."""
    run: Run = scoped_or_404(runs_for(principal), principal, run_id=run_id)
    return run


def _acting_on(principal: Principal, run_id: UUID) -> Run:
    """Look the run up first, so a viewer probing another tenant's id still gets 404."""
    run = scoped_run(principal, run_id)
    require_may_act(principal, "Viewers may look, not act.")
    return run


def _names_executors(principal: Principal, run: Run) -> bool:
    """Only a tenant admin names who executes an external run (issue 16 H1): a reviewer who
    could pick the executor could route a run to an agent of their choosing."""
    return principal.role == Role.ADMIN and run.external


def _compensates(principal: Principal) -> bool:
    """Only a tenant admin undoes a confirmed effect (DESIGN.md: `confirmed → compensated`
    is explicit and authorised). Like naming an executor, it is a lever over the tenant's
    own tools rather than a decision on one hold point, so a reviewer's `may_act` is not
    enough; the compensating action still meets the tenant's policies (held if one holds
    the undo tool), so an admin cannot slip an unreviewed effect past them."""
    return principal.role == Role.ADMIN


def _tenant_agents(principal: Principal) -> list[Any]:
    """The agent accounts of the principal's tenant, the only ones a run may be handed to."""
    agents = Membership.objects.filter(tenant=principal.tenant, role=Role.AGENT)
    return [m.user for m in agents.select_related("user").order_by("user__username")]


# --- small translations -----------------------------------------------------------------


def parse_json(text: str, field: str) -> Any:
    """Parse a textarea strictly (DESIGN.md: no duplicate keys, NaN or Infinity).

    A lenient parser would silently keep the last of two equal keys, so what a reviewer
    typed and what the run got could differ.
    """
    try:
        return parse_strict(text)
    except CanonicalError as exc:
        message = f"{field} is not valid JSON: {exc}"
        raise InvalidParams(message, errors={field: [message]}) from None


def _parse_rev(value: str | None, field: str) -> int:
    try:
        return int(value or "")
    except ValueError:
        raise InvalidParams(f"{field} is missing or not a number") from None


def _seen_token(run: Run) -> str:
    """What the page's forms were built from; when it changes the forms may be stale."""
    return f"{run.status}:{run.checkpoint_rev}:{run.goal_rev}"


# --- the runs list and starting a run ---------------------------------------------------


def _filtered_runs(principal: Principal, params: QueryDict) -> tuple[QuerySet[Run], dict[str, str]]:
    """The runs the query string's filters select, and the filters to show in the form.

    Validated by the API's own FilterSet: a NUL, an over-long value or a status word that
    does not exist is a 400 page naming the filter (issue 16, L1), never a database error.
    """
    runs = narrowed(RunFilter, params, runs_for(principal), empty_choice_is_error=False)
    shown = {name: params.get(name, "").strip() for name in RunFilter.base_filters}
    return runs, {name: value for name, value in shown.items() if value}


def _default_goal_text() -> str:
    try:
        goal = registry.latest(DEFAULT_GRAPH).default_goal
    except UnknownGraph:
        goal = None
    return pretty(goal if goal is not None else {})


def _graph_choices() -> list[dict[str, str]]:
    latest = (registry.latest(name) for name in registry.names())
    return [{"name": g.name, "version": g.version, "description": g.description} for g in latest]


def _render_runs(
    request: HttpRequest,
    principal: Principal,
    form: dict[str, str] | None = None,
    *,
    error: str = "",
    status: int = 200,
) -> HttpResponse:
    runs, filters = _filtered_runs(principal, request.GET)
    # run_id breaks ties so pages never overlap
    runs = runs.only(*LIST_FIELDS).order_by("-created_at", "-run_id")
    page = Paginator(runs, PAGE_SIZE).get_page(request.GET.get("page"))
    graphs = _graph_choices()
    graph_names = [g["name"] for g in graphs]
    if filters.get("graph") and filters["graph"] not in graph_names:
        graph_names.append(filters["graph"])  # runs of a graph no longer registered
    context = {
        "page_obj": page,
        "filters": filters,
        "statuses": RunStatus.values,
        "graphs": graphs,
        "filter_graphs": graph_names,
        "can_act": principal.may_act,
        "form": form or {"graph": DEFAULT_GRAPH, "goal": _default_goal_text(), "thread_id": ""},
        "error": error,
        "thread_id_max": Run._meta.get_field("thread_id").max_length,
    }
    return render(request, "runtime/runs.html", context, status=status)


def _start_run(request: HttpRequest, principal: Principal) -> HttpResponse:
    form = {
        "graph": request.POST.get("graph", ""),
        "goal": request.POST.get("goal", ""),
        "thread_id": request.POST.get("thread_id", "").strip(),
    }
    try:
        goal = parse_json(form["goal"], "goal")
        fields = {"graph": form["graph"], "goal": goal}
        if form["thread_id"]:
            fields["thread_id"] = form["thread_id"]
        valid = page_input(RunCreate, fields)
        run = create_run(
            principal.tenant,
            valid["graph"],
            goal,
            actor=principal.label,
            thread_id=valid.get("thread_id"),
        )
    except HoldpointError as exc:
        # Nothing was created: create_run writes the run and its first event atomically.
        return _render_runs(request, principal, form, error=exc.detail, status=exc.status)
    messages.success(request, f"Started {run.graph}@{run.graph_version} run {run.run_id}.")
    return redirect("run", run_id=run.run_id)


@reviewer_page(methods=("GET", "POST"), no_tenant="runtime/runs.html")
def runs_page(request: HttpRequest, principal: Principal) -> HttpResponse:
    """The tenant's runs, newest first, filterable; POST starts a run (not for viewers)."""
    if request.method == "POST":
        require_may_act(principal, "Viewers may look, not start runs.")
        return _start_run(request, principal)
    return _render_runs(request, principal)


# --- one run ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Waiting:
    """`run.waiting_for` as a reviewer reads it: a sentence, and a link to what is awaited."""

    sentence: str
    link_url: str = ""
    link_text: str = ""
    until: datetime | None = None
    prompt: str = ""


def waiting_of(run: Run) -> Waiting | None:
    """What the run waits for, in words, with where to go about it: the approval request
    (through `approval-for-action`, which finds the action's current request), the Reconcile
    page of the unproven action, the input form on this page, or the timer's time."""
    waiting = run.waiting_for
    if not waiting or not isinstance(waiting, dict):
        return None
    kind = str(waiting.get("kind", ""))
    tool = str(waiting.get("tool", "")) or "an action"
    prompt = str(waiting.get("prompt", "") or "")
    action_id = str(waiting.get("action_id", "") or "")
    until = _when(waiting.get("until"))
    if kind == "approval" and action_id:
        return Waiting(
            f"Waiting for a reviewer to approve or reject {tool}.",
            _url("approval-for-action", action_id),
            "Open the approval request →",
            prompt=prompt,
        )
    if kind == "reconciliation" and action_id:
        settled = _settled_status(run, action_id)
        if settled:  # a person (or a late answer) settled it: the run goes on without one
            return Waiting(
                f"{tool} was settled ({settled}); the run goes on when a worker takes it.",
                prompt=prompt,
            )
        return Waiting(
            f"Waiting for a person to settle whether {tool} happened: the service's answer "
            "did not prove it either way.",
            _url("reconcile-detail", action_id),
            "Settle it on the Reconcile page →",
            until=until,
            prompt=prompt,
        )
    if kind == "input":
        return Waiting(
            "Waiting for input: "
            + (prompt or "the run asks for data")
            + ". Send it with “Provide input” on this page.",
            "#input-data" if run.status == RunStatus.WAITING_INPUT else "",
            "Provide input →" if run.status == RunStatus.WAITING_INPUT else "",
        )
    if kind == "timer" or until is not None:
        return Waiting(
            "Waiting for a timer" + (f" ({prompt})" if prompt else "") + ": it wakes on its own",
            until=until,
        )
    return Waiting(f"Waiting ({kind or 'unknown'})" + (f": {prompt}" if prompt else "") + ".")


def _settled_status(run: Run, action_id: str) -> str:
    """The action's status once it no longer waits for a person ("" while it does, or when
    the id names nothing of the run's tenant): only then is the Reconcile page linked."""
    try:
        key = UUID(action_id)
    except ValueError:
        return ""
    status = (
        Action.objects.filter(pk=key, tenant_id=run.tenant_id)
        .values_list("status", flat=True)
        .first()
    )
    return "" if status in (None, ActionStatus.MANUAL_REVIEW) else str(status)


def _url(name: str, action_id: str) -> str:
    try:
        return reverse(name, args=[UUID(action_id)])
    except ValueError:
        return ""


def _when(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


def _pending_request() -> Subquery:
    """The id of an action's pending approval request, for the Actions table's link to it
    (no statement of its own). The model is reached through Action's reverse relation:
    runtime does not import approvals, which builds on it."""
    requests = Action._meta.get_field("approvals").related_model
    pending = requests._default_manager.filter(action=OuterRef("pk"), status="pending")
    return Subquery(pending.values("pk")[:1])


def _live_context(
    principal: Principal, run: Run, seen: str, state_rev: int | None = None
) -> dict[str, Any]:
    """What the live part shows: header, the Steps and Flow pictures, actions, timeline and
    whether the chain holds —
    and the State panel, re-rendered (out of band) only when the checkpoint moved past
    `state_rev`, the one the page shows, so a quiet poll never ships the state again."""
    stream = run_stream(run.run_id)
    journal = journal_for(principal).filter(stream=stream)
    entries = list(journal.order_by("-seq")[:TIMELINE_LIMIT])
    actions = list(
        actions_for(principal)
        .filter(run=run)
        .only("tool", "status", "goal_rev", "idempotency_key", "step", "compensates", "created_at")
        .annotate(pending_request=_pending_request())
        .order_by("-created_at")[: ACTION_LIMIT + 1]
    )
    chain_break: Break | None = verify_stream(stream)
    state: dict[str, Any] = {"state_oob": False}
    if state_rev is None or state_rev != run.checkpoint_rev:
        value, state_error = _checkpoint_state(principal, run)
        state = {
            "state_json": pretty(value) if not state_error else "",
            "state_error": state_error,
            "state_oob": state_rev is not None,
        }
    return {
        "run": run,
        "goal_json": pretty(run.goal),
        "timeline": [timeline_row(e) for e in entries],
        # Seqs count from 1 without gaps (the chain check proves it), so the newest is the
        # total: no COUNT query per poll.
        "timeline_total": entries[0].seq if entries else 0,
        "actions": actions[:ACTION_LIMIT],
        "more_actions": len(actions) > ACTION_LIMIT,
        "chain_break": chain_break,
        "live_url": reverse("run-live", args=[run.run_id])
        + "?"
        + urlencode({"seen": seen, "state": run.checkpoint_rev}),
        "stale": seen != _seen_token(run),
        "waiting": waiting_of(run),
        **picture_context(run, journal),
        **state,
    }


def _checkpoint_state(principal: Principal, run: Run) -> tuple[Any, str]:
    """The latest checkpoint's state, decoded; or why it cannot be shown."""
    if run.checkpoint_rev == 0:
        return None, "No checkpoint yet: the first step has not committed."
    checkpoint = checkpoints_for(principal).filter(run=run, rev=run.checkpoint_rev).first()
    if checkpoint is None:
        return None, f"Checkpoint {run.checkpoint_rev} is missing."
    try:
        return resolve(run.tenant_id, checkpoint.state), ""
    except LookupError as exc:  # artifacts purged by retention
        return None, f"State unavailable: {exc}"


def _compensable(principal: Principal, run: Run) -> list[tuple[Action, str]]:
    """The run's confirmed actions an admin may undo now, each with its undo tool's name:
    the tool they were sent with declares a compensation, and none is under way (one asked
    for before that ended without effect — rejected, withdrawn, refused by the undo tool —
    is shown beside the form as `earlier_undo`, what became of it)."""
    if not _compensates(principal):
        return []
    undos = Action.objects.filter(compensates=OuterRef("pk"), tenant_id=OuterRef("tenant_id"))
    latest = undos.order_by("-created_at")
    confirmed = (
        actions_for(principal)
        .filter(run=run, status=ActionStatus.CONFIRMED)
        .exclude(Exists(undos.exclude(status__in=ENDED_UNSENT)))
        .annotate(
            earlier_undo_status=Subquery(latest.values("status")[:1]),
            earlier_undo_error=Subquery(latest.values("last_error")[:1]),
        )
        .only("tool", "tool_version", "tenant_id", "idempotency_key", "external_id")
        .order_by("-created_at")[:ACTION_LIMIT]
    )
    found: list[tuple[Action, str]] = []
    for action in confirmed:
        try:
            undo = tool_of(action).compensation
        except HoldpointError:  # a definition since removed: nothing to compensate with
            continue
        if undo:
            found.append((action, undo))
    return found


def _unsent_compensations(principal: Principal, run: Run) -> list[Action]:
    """The run's compensations whose last send could not reach their tool and that are still
    unsent, for a tenant admin (who asked for them) to see why and send again. One merely
    queued has no failure on its row and is not listed: its ring is on its way."""
    if not _compensates(principal):
        return []
    unsent = (
        actions_for(principal)
        .filter(
            run=run,
            compensates__isnull=False,
            status__in=SENDABLE,
            send_failed_at__isnull=False,
        )
        .select_related("compensates")
        .order_by("-send_failed_at")
    )
    return list(unsent[:ACTION_LIMIT])


def _render_run(
    request: HttpRequest,
    principal: Principal,
    run: Run,
    *,
    drafts: dict[str, str] | None = None,
    errors: dict[str, str] | None = None,
    status: int = 200,
) -> HttpResponse:
    drafts = drafts or {}
    context = {
        **_live_context(principal, run, _seen_token(run)),
        "can_act": principal.may_act and not run.is_terminal,
        "resumable": run.status in RESUMABLE
        or (run.status == RunStatus.QUEUED and run.wake_at is not None),
        "goal_draft": drafts.get("goal", pretty(run.goal)),
        "input_draft": drafts.get("input", "{}"),
        "executor_choices": (
            [a.get_username() for a in _tenant_agents(principal)]
            if _names_executors(principal, run)
            else []
        ),
        "compensable": _compensable(principal, run),
        "unsent_compensations": _unsent_compensations(principal, run),
        "reason_max": REASON_MAX,
        "errors": errors or {},
    }
    response = render(request, "runtime/run.html", context, status=status)
    patch_vary_headers(response, ("HX-Request",))
    return response


@reviewer_page(no_tenant="runtime/run.html")
def run_page(request: HttpRequest, principal: Principal, run_id: UUID) -> HttpResponse:
    """One run: header, state, actions, timeline, and the levers for reviewers."""
    return _render_run(request, principal, scoped_run(principal, run_id))


@reviewer_page()
def run_live(request: HtmxHttpRequest, principal: Principal, run_id: UUID) -> HttpResponse:
    """The part of the run page htmx polls; rendered without the poll once the run ended.

    Opened directly (not by htmx) it answers the whole page, so the URL is never a bare
    fragment in a browser tab.
    """
    run = scoped_run(principal, run_id)
    if not request.htmx:
        return _render_run(request, principal, run)
    seen = request.GET.get("seen", "")
    shown_rev = request.GET.get("state", "")
    state_rev = int(shown_rev) if shown_rev.isdigit() else -1  # unknown: send the state
    context = _live_context(principal, run, seen, state_rev)
    response = render(request, "runtime/_run_live.html", context)
    patch_vary_headers(response, ("HX-Request",))
    return response


# --- the levers -------------------------------------------------------------------------


def _pull(request: HttpRequest, run: Run, lever: Callable[[], str]) -> HttpResponse:
    """Call a lifecycle function; its refusal is a message, never a 500."""
    try:
        messages.success(request, lever())
    except HoldpointError as exc:
        messages.error(request, exc.detail)
    return redirect("run", run_id=run.run_id)


def _json_draft_or_page(
    request: HttpRequest, principal: Principal, run: Run, field: str
) -> tuple[Any, HttpResponse | None]:
    """The textarea's JSON, or the run page again with the draft kept and the error shown."""
    text = request.POST.get(field, "")
    try:
        return parse_json(text, field), None
    except InvalidParams as exc:
        page = _render_run(
            request,
            principal,
            run,
            drafts={field: text},
            errors={field: exc.detail},
            status=exc.status,
        )
        return None, page


@reviewer_page(methods=("POST",))
def run_cancel(request: HttpRequest, principal: Principal, run_id: UUID) -> HttpResponse:
    run = _acting_on(principal, run_id)
    reason = page_input(CancelIn, {"reason": request.POST.get("reason", "").strip()})["reason"]

    def lever() -> str:
        cancel_run(run, reason, actor=principal.label)
        return "Run cancelled."

    return _pull(request, run, lever)


@reviewer_page(methods=("POST",))
def run_resume(request: HttpRequest, principal: Principal, run_id: UUID) -> HttpResponse:
    run = _acting_on(principal, run_id)
    before = run.status

    def lever() -> str:
        expected = request.POST.get("expected_rev")
        resume_run(
            run,
            actor=principal.label,
            expected_rev=_parse_rev(expected, "expected_rev") if expected else None,
        )
        if run.status == before:
            return f"Nothing to resume: the run is {run.status}. Workers were notified."
        return f"Resumed: the run is {run.status}."

    return _pull(request, run, lever)


@reviewer_page(methods=("POST",))
def run_input(request: HttpRequest, principal: Principal, run_id: UUID) -> HttpResponse:
    run = _acting_on(principal, run_id)
    data, page = _json_draft_or_page(request, principal, run, "input")
    if page is not None:
        return page

    def lever() -> str:
        expected = _parse_rev(request.POST.get("expected_rev"), "expected_rev")
        provide_input(run, data, expected, actor=principal.label)
        return "Input delivered: the run is queued to continue."

    return _pull(request, run, lever)


@reviewer_page(methods=("POST",))
def run_revise(request: HttpRequest, principal: Principal, run_id: UUID) -> HttpResponse:
    run = _acting_on(principal, run_id)
    goal, page = _json_draft_or_page(request, principal, run, "goal")
    if page is not None:
        return page

    def lever() -> str:
        expected = _parse_rev(request.POST.get("expected_goal_rev"), "expected_goal_rev")
        revise_goal(run, goal, expected, actor=principal.label)
        return f"Goal revised: now revision {run.goal_rev}."

    return _pull(request, run, lever)


@reviewer_page(methods=("POST",))
def run_executor(request: HttpRequest, principal: Principal, run_id: UUID) -> HttpResponse:
    """The tenant admin's door to `name_executor`: which agent account executes the run."""
    run = scoped_run(principal, run_id)
    if principal.role != Role.ADMIN:
        raise PermissionDenied("Only a tenant admin names a run's executor.")
    wanted = request.POST.get("executor_account", "")
    # Matched in Python against the tenant's agents: an odd value never reaches a query.
    account = next((a for a in _tenant_agents(principal) if a.get_username() == wanted), None)
    if account is None:
        raise InvalidParams(
            "executor_account: not an agent account of this tenant",
            errors={"executor_account": ["not an agent account of this tenant"]},
        )

    def lever() -> str:
        name_executor(run, account, actor=principal.label)
        return f"{wanted} now executes this run; other agents' leases are refused."

    return _pull(request, run, lever)


class CompensateIn(serializers.Serializer[Any]):
    """The compensate form: a reason is required (it is journalled and, where the undo tool
    takes one, sent), no longer than `compensate` keeps."""

    reason = StrictChar(max_length=REASON_MAX)


@reviewer_page(methods=("POST",))
def action_compensate(request: HttpRequest, principal: Principal, action_id: UUID) -> HttpResponse:
    """The tenant admin's door to `runtime.compensation.compensate`, the one writer: it
    decides whether the action can still be compensated (confirmed, a compensation declared,
    none under way: asking twice answers the same one); its refusal is a message."""
    action: Action = scoped_or_404(
        actions_for(principal).select_related("run"), principal, action_id=action_id
    )
    if not _compensates(principal):
        raise PermissionDenied("Only a tenant admin compensates an action.")
    reason = page_input(CompensateIn, {"reason": request.POST.get("reason", "")})["reason"]

    def lever() -> str:
        undo = compensate(action, reason, actor=principal.label)
        then = (
            "It waits for a reviewer's approval."
            if undo.status == ActionStatus.AWAITING_APPROVAL
            else f"It is {undo.status}."
        )
        return f"Compensating {action.tool} {action.idempotency_key} with {undo.tool}. {then}"

    return _pull(request, action.run, lever)


@reviewer_page(methods=("POST",))
def action_send_again(request: HttpRequest, principal: Principal, action_id: UUID) -> HttpResponse:
    """The tenant admin's "send it now" for a compensation whose send could not reach its tool
    (`runtime.compensation.send_again`, which rings its dispatcher; the send is the write).
    The same who and order as asking for the compensation: looked up in the tenant first
    (another tenant's id is a missing id's 404), then a non-admin is refused."""
    action: Action = scoped_or_404(
        actions_for(principal).select_related("run"), principal, action_id=action_id
    )
    if not _compensates(principal):
        raise PermissionDenied("Only a tenant admin sends a compensation again.")

    def lever() -> str:
        send_again(action, actor=principal.label)
        return (
            f"Sending {action.tool} {action.idempotency_key} again. Once it is sent its status "
            "changes here; if the tool still cannot be reached, this page says so again."
        )

    return _pull(request, action.run, lever)
