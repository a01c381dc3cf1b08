"""Reviewer pages for hold points: the inbox, its history, one request, and deciding it.

The views only handle HTTP: they translate it into one call of `approvals.decisions.decide`
and back, and render what `approvals.inbox` (queries), `approvals.forms` (the params form)
and `approvals.wording` (expiry and outcomes in words) give them. They never decide whether
a decision is allowed — permission, separation of duties, expiry, the action hash,
"already decided", which fields are editable: all of that is `decide`'s call, and its
refusal (a HoldpointError) becomes a message on the request page, never a 500. What the
pages compute themselves (who may decide which card, what happens at expiry) is display
only; `decide` checks it all again under row locks.

GET never decides: mail scanners and link prefetchers open links before people do
(NOTES.md), so only a POST from the request page, carrying the action hash the server
rendered into it, records anything. Every read goes through `approvals_for` and the runtime
tenancy helpers, so another tenant's request is a 404 exactly like a random id.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any
from uuid import UUID

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse, QueryDict
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.utils.cache import patch_vary_headers

from approvals.api import DecisionIn
from approvals.card import card_for
from approvals.decisions import PRESET_REJECT_REASONS, decide
from approvals.forms import diff_rows, param_fields, property_order, typed_edits
from approvals.hashing import action_hash, same_hash
from approvals.inbox import (
    Filters,
    decided_requests,
    deciding_for,
    inbox_context,
    newer_request,
    next_pending,
    request_timeline,
    similar_decisions,
)
from approvals.models import ApprovalRequest, ApprovalStatus, Decision
from approvals.overview import tenant_overview
from approvals.policies import may_decide, shaped_by
from approvals.scoping import approvals_for
from approvals.wording import done_text, expiry_of, graph_of, refusal_text, undoes
from runtime.accounts import decision_rate_limited
from runtime.errors import FieldNotEditable, HoldpointError, InvalidParams, NotPermitted
from runtime.pages import pretty, reviewer_page, scoped_or_404
from runtime.pages.access import page_input
from runtime.tenancy import Principal

A = ApprovalStatus
PAGE_SIZE = 50


# --- access -----------------------------------------------------------------------------


def _scoped_request(principal: Principal, request_id: UUID) -> ApprovalRequest:
    """The request if it is the principal's tenant's; any other case is the same plain 404."""
    return scoped_or_404(
        approvals_for(principal).select_related(
            "policy", "run", "run__executor_account", "action", "decided_by"
        ),
        principal,
        pk=request_id,
    )


# --- the inbox --------------------------------------------------------------------------


def _inbox_context(principal: Principal, request: HttpRequest) -> dict[str, Any]:
    """The inbox's data for the query string's filters, and the page's two links."""
    filters = Filters.parse(request.GET)
    context = inbox_context(principal, filters)
    query = filters.query()
    first = context["cards"][0].request if context["cards"] else None
    context["list_url"] = reverse("inbox-list") + (f"?{query}" if query else "")
    context["next_url"] = reverse("approval-page", args=[first.pk]) if first else ""
    return context


def _inbox_page(request: HttpRequest, principal: Principal, template: str) -> HttpResponse:
    response = render(request, template, _inbox_context(principal, request))
    patch_vary_headers(response, ("HX-Request",))
    return response


@reviewer_page(no_tenant="approvals/inbox.html")
def inbox(request: HttpRequest, principal: Principal) -> HttpResponse:
    """Pending hold points of the current tenant, soonest expiry first, and what waits for
    reconciliation."""
    return _inbox_page(request, principal, "approvals/inbox.html")


@reviewer_page(no_tenant="approvals/inbox.html")
def inbox_list(request: HttpRequest, principal: Principal) -> HttpResponse:
    """The part of the inbox htmx polls every 5 s. Opened directly (not by htmx) it answers
    the whole page, so the URL is never a bare fragment in a browser tab."""
    if not getattr(request, "htmx", False):
        return _inbox_page(request, principal, "approvals/inbox.html")
    return _inbox_page(request, principal, "approvals/_inbox_list.html")


@reviewer_page(no_tenant="approvals/history.html")
def history(request: HttpRequest, principal: Principal) -> HttpResponse:
    """Decided requests (any end state), newest first, with who decided and why."""
    page = Paginator(decided_requests(principal), PAGE_SIZE).get_page(request.GET.get("page"))
    return render(request, "approvals/history.html", {"page_obj": page})


@reviewer_page(no_tenant="approvals/overview.html")
def overview(request: HttpRequest, principal: Principal) -> HttpResponse:
    """How the tenant's work stands: runs, waiting approvals, turnaround, backlog."""
    context = {"overview": tenant_overview(principal, timezone.now())}
    return render(request, "approvals/overview.html", context)


# --- one request: the page --------------------------------------------------------------


def _why_not(
    principal: Principal, found: ApprovalRequest, permitted: bool, voted: bool, now: datetime
) -> str:
    """Why no decision forms are shown (display only: `decide` is the authority)."""
    if found.status != A.PENDING:
        return ""
    if not permitted:
        return "You may look at this request; deciding needs a reviewer granted on its policy."
    if found.policy.separation_of_duties and principal.label in shaped_by(found, found.run):
        return (
            "You shaped this action (you started the run, revised its goal, or gave it input "
            "since its last decision): someone else must decide it."
        )
    if voted:
        return "You already voted; the request waits for more approvals."
    if found.expires_at <= now:
        return "This request has expired; it is no longer open for a decision."
    return ""


def _request_context(
    principal: Principal,
    found: ApprovalRequest,
    *,
    drafts: dict[str, str] | None = None,
    errors: dict[str, list[str]] | None = None,
) -> dict[str, Any]:
    now = timezone.now()
    shown = found.shown or {}
    permitted = may_decide(principal.user, found.policy, escalated=found.escalated)
    votes = list(found.votes.select_related("user").order_by("created_at"))
    voted = any(v.user_id == principal.user.pk for v in votes)
    why_not = _why_not(principal, found, permitted, voted, now)
    can_decide = found.status == A.PENDING and permitted and not why_not
    params = json.loads(found.edited_params or found.params)
    pending = found.status == A.PENDING
    # The action itself moved after the request was raised (a bug, an admin, raw SQL): the
    # request can no longer be approved as shown, and the reviewer should know why.
    action_changed = pending and not same_hash(action_hash(found.action), found.action_hash)
    following = next_pending(principal, deciding_for(principal), found)
    return {
        "req": found,
        "card": card_for(principal, found),
        "shown": shown,
        "run": found.run,
        "fields": param_fields(shown, params, enabled=can_decide, drafts=drafts, errors=errors),
        "editable": list(shown.get("editable") or ()),
        "field_errors": errors or {},
        "schema_json": pretty(shown.get("schema") or {}),
        "diff": diff_rows(
            json.loads(found.params),
            json.loads(found.edited_params),
            property_order(shown, (shown.get("schema") or {}).get("properties") or {}),
        )
        if found.edited_params
        else [],
        "expiry": expiry_of(
            found.expires_at,
            found.policy.on_expiry,
            found.rerequest_count,
            now,
            graph=graph_of(found),
            undo=bool(undoes(found)),
        )
        if pending
        else None,
        "can_decide": can_decide,
        "why_not": why_not,
        "votes": votes,
        "action_changed": action_changed,
        "current_action_params": pretty(json.loads(found.action.params)) if action_changed else "",
        "similar": similar_decisions(principal, shown.get("tool", found.action.tool), found),
        "newer": None if pending else newer_request(principal, found),
        "history": request_timeline(principal, found),
        "presets": PRESET_REJECT_REASONS,
        "next_url": reverse("approval-page", args=[following.pk]) if following else "",
        "status_url": _status_url(found),
        "hash_short": found.action_hash[:12],
        "reason_draft": (drafts or {}).get("__reason", ""),
        "preset_draft": (drafts or {}).get("__preset", ""),
    }


def _seen_token(found: ApprovalRequest) -> str:
    """What the page's forms were built from; when it changes the forms are stale."""
    return f"{found.status}:{found.action_hash}"


def _status_url(found: ApprovalRequest) -> str:
    query = QueryDict(mutable=True)
    query["seen"] = _seen_token(found)
    return reverse("approval-page-status", args=[found.pk]) + "?" + query.urlencode()


def _render_request(
    request: HttpRequest,
    principal: Principal,
    found: ApprovalRequest,
    *,
    drafts: dict[str, str] | None = None,
    errors: dict[str, list[str]] | None = None,
    status: int = 200,
) -> HttpResponse:
    context = _request_context(principal, found, drafts=drafts, errors=errors)
    return render(request, "approvals/request.html", context, status=status)


@reviewer_page(no_tenant="approvals/request.html")
def request_page(request: HttpRequest, principal: Principal, request_id: UUID) -> HttpResponse:
    """Everything the reviewer is shown, the params as a form, and the decision forms."""
    return _render_request(request, principal, _scoped_request(principal, request_id))


@reviewer_page()
def request_for_action(request: HttpRequest, principal: Principal, action_id: UUID) -> HttpResponse:
    """The request an action waits on (its pending one, else its latest): how the run page,
    which knows only the action it waits for, links to the approval (runtime does not
    import approvals). Another tenant's action is the same 404 as no action."""
    requests = approvals_for(principal).filter(action_id=action_id)
    found = (
        requests.filter(status=A.PENDING).only("id").first()
        or requests.only("id").order_by("-created_at").first()
    )
    if found is None:
        raise Http404("No approval request for this action.")
    return redirect("approval-page", request_id=found.pk)


@reviewer_page()
def request_status(request: HttpRequest, principal: Principal, request_id: UUID) -> HttpResponse:
    """The status line htmx polls on the request page: the countdown, and a notice when the
    request changed or was decided elsewhere since the page was loaded."""
    found = _scoped_request(principal, request_id)
    now = timezone.now()
    context = {
        "req": found,
        "status_url": _status_url(found),
        "stale": request.GET.get("seen", "") != _seen_token(found),
        "expiry": expiry_of(
            found.expires_at,
            found.policy.on_expiry,
            found.rerequest_count,
            now,
            graph=graph_of(found),
            undo=bool(undoes(found)),
        )
        if found.status == A.PENDING
        else None,
    }
    response = render(request, "approvals/_request_status.html", context)
    patch_vary_headers(response, ("HX-Request",))
    return response


# --- deciding ---------------------------------------------------------------------------


def _reason(post: QueryDict, decision: str) -> tuple[str, str, str]:
    """(reason for `decide`, the preset picked, the free text) — a preset alone is a reason;
    a preset with text is both, so the journal keeps the category and the explanation."""
    note = post.get("reason", "").strip()
    preset = post.get("preset", "").strip()
    if decision != Decision.REJECT or preset not in PRESET_REJECT_REASONS:
        preset = ""
    reason = f"{preset}: {note}" if preset and note else preset or note
    return reason, preset, note


@reviewer_page(methods=("POST",))
@decision_rate_limited
def decide_page(request: HttpRequest, principal: Principal, request_id: UUID) -> HttpResponse:
    """Hand the reviewer's decision to `decide`; an approval goes on to the next item of
    the inbox, a rejection shows the rejected request and what the run does next."""
    found = _scoped_request(principal, request_id)  # 404 first: no oracle for other tenants
    if not may_decide(principal.user, found.policy, escalated=found.escalated):
        raise PermissionDenied("You may look at this request, not decide it.")
    decision = request.POST.get("decision", "")
    reason, preset, note = _reason(request.POST, decision)
    # `decide` validates the decision word and compares the hash (messages on the page);
    # the texts it stores or journals are checked here as the API checks them.
    texts = {"reason": reason, "action_hash": request.POST.get("action_hash", "")}
    said = page_input(DecisionIn, {k: v for k, v in texts.items() if v}, partial=True)
    params = json.loads(found.edited_params or found.params)
    drafts: dict[str, str] = {"__reason": note, "__preset": preset}
    edits: dict[str, Any] | None = None
    try:
        if decision == Decision.APPROVE:
            edits, field_drafts = typed_edits(request.POST, found.shown or {}, params)
            drafts.update(field_drafts)
        decided = decide(
            found.pk,
            principal.user,
            decision,
            said.get("action_hash", ""),
            reason=said.get("reason", ""),
            edits=edits or None,
        )
    except (InvalidParams, FieldNotEditable) as exc:
        # Nothing was written (decide's transaction rolled back): show the page again with
        # what the reviewer typed, and say what to fix.
        drafts.update(exc.extra.get("drafts") or {})
        errors = dict(exc.extra.get("errors") or {})
        messages.error(request, exc.detail[:1].upper() + exc.detail[1:], extra_tags=exc.code)
        return _render_request(
            request, principal, found, drafts=drafts, errors=errors, status=exc.status
        )
    except NotPermitted as exc:
        # Not a stale page but a rule about this reviewer: answered as a 403, on the page.
        messages.error(request, refusal_text(exc, found), extra_tags=exc.code)
        return _render_request(request, principal, found, drafts=drafts, status=exc.status)
    except HoldpointError as exc:
        messages.error(request, refusal_text(exc, found), extra_tags=exc.code)
        return redirect("approval-page", request_id=found.pk)
    messages.success(request, done_text(decided, decision, edits))
    if decided.status == A.REJECTED:
        # A reject lands on the rejected request itself ("Rejected — next: ..."), never on
        # the next item: the next request of a similar run often has the same title, and
        # the reviewer would see no sign that anything happened (issue 20).
        return redirect("approval-page", request_id=decided.pk)
    following = next_pending(principal, deciding_for(principal), decided)
    if following is None:
        return redirect("inbox")
    return redirect("approval-page", request_id=following.pk)
