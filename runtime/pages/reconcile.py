"""Reviewer pages for manual reconciliation: actions whose outcome nothing could prove.

An action lands in `manual_review` when its tool can neither deduplicate nor be looked up
(or reconciling failed too often): only a human who checked the service can say whether the
effect happened (DESIGN.md, invariants 2–3). These pages show everything the ledger knows,
so that human decides on facts, and hand the answer to `runtime.outcomes.resolve`. They never
decide themselves: whether "not applied" is allowed yet (the sender may still be in flight),
whether the action is still open, whether "applied" has its proof — all of that is
`resolve`'s call, and its refusal becomes a message on the page. Every read goes through the
tenancy helpers, so another tenant's action is a 404 exactly like one that does not exist.
"""

from __future__ import annotations

import json
from typing import Any
from uuid import UUID

from django.contrib import messages
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone

from audit.journal import run_stream
from runtime.api.serializers import ResolveIn
from runtime.errors import HoldpointError
from runtime.models import Action, ActionStatus
from runtime.outcomes import resolve
from runtime.pages.access import page_input, require_may_act, reviewer_page, scoped_or_404
from runtime.pages.display import TimelineRow, pretty, timeline_row
from runtime.tenancy import Principal, actions_for, journal_for

PAGE_SIZE = 50
# The journal rows of one action shown on its page: a run retrying for days must not make
# the page unbounded; the newest are the ones a reviewer needs.
HISTORY_LIMIT = 200
# The list shows these only, so an action's params or result (possibly large) are never
# loaded for a list row.
LIST_FIELDS = (
    "action_id",
    "run",
    "tool",
    "idempotency_key",
    "attempts",
    "reconcile_attempts",
    "last_error",
    "sent_at",
    "target",
    "reason",
    "created_at",
)
# What the reviewer is told after `resolve` accepted their answer (it validated `outcome`).
SAID = {
    "applied": ("applied", "It is confirmed."),
    "not_applied": ("not applied", "It will be sent again with the same key."),
}


# --- access -----------------------------------------------------------------------------


def _scoped_action(principal: Principal, action_id: UUID) -> Action:
    """The action if it is the principal's tenant's; any other case is the same plain 404."""
    action: Action = scoped_or_404(
        actions_for(principal).select_related("run"), principal, action_id=action_id
    )
    return action


def _acting_on(principal: Principal, action_id: UUID) -> Action:
    """Look the action up first, so a viewer probing another tenant's id still gets 404."""
    action = _scoped_action(principal, action_id)
    require_may_act(principal, "Viewers may look, not resolve.")
    return action


# --- the list ---------------------------------------------------------------------------


@reviewer_page(no_tenant="runtime/reconcile_list.html")
def reconcile_list(request: HttpRequest, principal: Principal) -> HttpResponse:
    """The tenant's actions waiting for a human to say whether they happened, newest first."""
    actions = (
        actions_for(principal)
        .filter(status=ActionStatus.MANUAL_REVIEW)
        .only(*LIST_FIELDS)
        .order_by("-created_at", "-action_id")  # action_id breaks ties so pages never overlap
    )
    page = Paginator(actions, PAGE_SIZE).get_page(request.GET.get("page"))
    return render(request, "runtime/reconcile_list.html", {"page_obj": page})


# --- one action -------------------------------------------------------------------------


def _history(principal: Principal, action: Action) -> list[TimelineRow]:
    """This action's entries in its run's journal (prepared, sent, outcomes, resolutions).

    Read from the run's stream by the payload's action_id, so a resolution shows who decided
    what next to the outcomes that made a human necessary.
    """
    entries = (
        journal_for(principal)
        .filter(stream=run_stream(action.run_id), payload__action_id=str(action.action_id))
        .order_by("-seq")[:HISTORY_LIMIT]
    )
    return [timeline_row(e) for e in entries]


def _detail_context(principal: Principal, action: Action) -> dict[str, Any]:
    now = timezone.now()
    in_flight = action.in_flight_until is not None and action.in_flight_until > now
    open_ = action.status == ActionStatus.MANUAL_REVIEW
    return {
        "action": action,
        "run": action.run,
        # Stored canonical text: always valid JSON, shown indented for reading.
        "params_json": pretty(json.loads(action.params)),
        "result_json": pretty(action.result) if action.result is not None else "",
        "in_flight": in_flight,
        "open": open_,
        "can_resolve": principal.may_act and open_,
        "history": _history(principal, action),
    }


@reviewer_page(no_tenant="runtime/reconcile_detail.html")
def reconcile_detail(request: HttpRequest, principal: Principal, action_id: UUID) -> HttpResponse:
    """Everything known about one action, and the two answers a reviewer may give."""
    action = _scoped_action(principal, action_id)
    return render(request, "runtime/reconcile_detail.html", _detail_context(principal, action))


@reviewer_page(methods=("POST",))
def reconcile_resolve(request: HttpRequest, principal: Principal, action_id: UUID) -> HttpResponse:
    """Hand the reviewer's answer to `resolve`; its refusal is a message, never a 500."""
    action = _acting_on(principal, action_id)
    post = request.POST
    # `resolve` validates the outcome word itself (a message on the page); the free texts,
    # which it stores, are checked here as the API checks them.
    texts = {"external_id": post.get("external_id", ""), "note": post.get("note", "").strip()}
    answer = page_input(ResolveIn, texts, partial=True)
    outcome = post.get("outcome", "")
    try:
        settled = resolve(
            action,
            outcome,
            actor=principal.label,
            external_id=answer["external_id"],
            note=answer["note"],
        )
    except HoldpointError as exc:
        messages.error(request, exc.detail)
        return redirect("reconcile-detail", action_id=action.action_id)
    said, then = SAID[outcome]
    if settled.status == ActionStatus.CANCELLED:
        then = "Nothing will send it now: it is withdrawn."
    messages.success(
        request, f"Recorded: {action.tool} {action.idempotency_key} was {said}. {then}"
    )
    return redirect("run", run_id=action.run_id)
