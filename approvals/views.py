"""Reviewer pages for hold points: the inbox, its history, one request, and deciding it.

The views translate HTTP into one call of `approvals.decisions.decide` and back. They never
decide whether a decision is allowed — permission, separation of duties, expiry, the action
hash, "already decided", which fields are editable: all of that is `decide`'s call, and its
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
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from uuid import UUID

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db.models import (
    BooleanField,
    Count,
    Exists,
    ExpressionWrapper,
    F,
    OuterRef,
    Q,
    QuerySet,
    Value,
)
from django.db.models.fields.json import KT
from django.db.models.functions import Coalesce
from django.http import Http404, HttpRequest, HttpResponse, QueryDict
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.utils.cache import patch_vary_headers
from django.views.decorators.http import require_http_methods

from approvals.decisions import PRESET_REJECT_REASONS, decide
from approvals.hashing import action_hash, same_hash
from approvals.models import (
    ApprovalPolicy,
    ApprovalRequest,
    ApprovalStatus,
    ApprovalVote,
    Decision,
    OnExpiry,
)
from approvals.policies import may_decide
from approvals.scoping import approvals_for
from audit.canonical import CanonicalError, parse_strict
from audit.journal import run_stream
from runtime.accounts import decision_rate_limited
from runtime.errors import (
    AlreadyDecided,
    Expired,
    FieldNotEditable,
    HashMismatch,
    HoldpointError,
    InvalidParams,
    NotFound,
    NotPermitted,
)
from runtime.models import ActionStatus, Run
from runtime.pages import TimelineRow, _principal, pretty, summarise
from runtime.tenancy import Principal, actions_for, get_scoped, journal_for, scope
from runtime.tools import get_tool

A = ApprovalStatus
DECIDED = (A.APPROVED, A.REJECTED, A.EXPIRED, A.SUPERSEDED, A.CANCELLED)
PAGE_SIZE = 50
# The inbox shows the soonest-to-expire this many; the counts still tell the whole truth.
# Rendering the cards is most of the page's time (issue 8: ~0.8 ms a card; 100 cards put
# the p95 of a busy tenant's inbox over 100 ms), and the list is re-fetched every 5 s.
INBOX_LIMIT = 50
RECONCILE_LIMIT = 20
SIMILAR_LIMIT = 5
HISTORY_LIMIT = 50
# A string field longer than this (or with line breaks) gets a textarea.
SHORT_TEXT = 300
# Where the inbox's cards come from: the columns a card shows, nothing else. The card's
# words from `shown` are read as JSON keys by the database, so a large params value or
# schema is never loaded for a card.
CARD_FIELDS = (
    "id",
    "title",
    "run",
    "policy__name",
    "policy__on_expiry",
    "expires_at",
    "escalated",
    "rerequest_count",
    "quorum",
    "created_at",
    "status",
)
THEN = {
    OnExpiry.REJECT: "then it is rejected automatically",
    OnExpiry.APPROVE: "then it is approved automatically (the policy says so explicitly)",
}


# --- access -----------------------------------------------------------------------------


def _scoped_request(principal: Principal | None, request_id: UUID) -> ApprovalRequest:
    """The request if it is the principal's tenant's; any other case is the same plain 404."""
    if principal is None:
        raise Http404()
    try:
        found: ApprovalRequest = get_scoped(
            approvals_for(principal).select_related("policy", "run", "action", "decided_by"),
            principal,
            pk=request_id,
        )
    except NotFound:
        raise Http404() from None
    return found


@dataclass(frozen=True)
class Deciding:
    """Which pending requests a user may decide, as a filter the database evaluates.

    Built once per page from `may_decide` per (policy, escalated) pair that has pending
    requests — a handful of queries however many cards there are. Separation of duties and
    "already voted" are mirrored here for display only; `decide` re-checks all of it.
    """

    user: AbstractBaseUser
    label: str
    plain: frozenset[int]
    escalated: frozenset[int]

    @classmethod
    def of(cls, principal: Principal, pairs: set[tuple[int, bool]]) -> Deciding:
        policies = scope(ApprovalPolicy.objects.all(), principal).filter(
            pk__in={pid for pid, _ in pairs}
        )
        plain: set[int] = set()
        escalated: set[int] = set()
        for policy in policies:
            if may_decide(principal.user, policy):
                plain.add(policy.pk)
                escalated.add(policy.pk)
            elif (policy.pk, True) in pairs and may_decide(principal.user, policy, escalated=True):
                escalated.add(policy.pk)
        return cls(principal.user, principal.label, frozenset(plain), frozenset(escalated))

    def q(self) -> Q:
        allowed = Q(pk__in=[])
        if self.plain:
            allowed |= Q(policy_id__in=self.plain)
        if self.escalated - self.plain:
            allowed |= Q(escalated=True, policy_id__in=self.escalated - self.plain)
        voted = ApprovalVote.objects.filter(request=OuterRef("pk"), user=self.user)
        # The run's initiator by its primary key, per request: a join here made the
        # inbox's counts scan every run of the database (issue 8, EXPLAIN ANALYZE).
        own_run = Run.objects.filter(
            pk=OuterRef("run_id"), tenant_id=OuterRef("tenant_id"), created_by=self.label
        )
        return allowed & ~(Q(policy__separation_of_duties=True) & Exists(own_run)) & ~Exists(voted)

    @property
    def anything(self) -> bool:
        return bool(self.plain or self.escalated)


def _pending(principal: Principal) -> QuerySet[ApprovalRequest]:
    return approvals_for(principal).filter(status=A.PENDING)


def _pending_pairs(principal: Principal) -> list[tuple[int, str, bool, str]]:
    """(policy id, policy name, escalated, tool) of every pending request, distinct."""
    rows = (
        _pending(principal)
        .annotate(tool_name=KT("shown__tool"))
        .values_list("policy_id", "policy__name", "escalated", "tool_name")
        .order_by()
        .distinct()
    )
    return list(rows)


def _deciding(principal: Principal) -> Deciding:
    return Deciding.of(principal, {(pid, esc) for pid, _, esc, _ in _pending_pairs(principal)})


def _next_pending(
    principal: Principal, deciding: Deciding, after: ApprovalRequest | None
) -> ApprovalRequest | None:
    """The next item in inbox order (soonest expiry first) after `after`, wrapping round.

    Only requests this user may still decide when they may decide any; otherwise every
    pending one, so a viewer can still page through.
    """
    pending = _pending(principal).order_by("expires_at", "pk").only("id", "expires_at")
    if deciding.anything:
        pending = pending.filter(deciding.q())
    if after is None:
        return pending.first()
    pending = pending.exclude(pk=after.pk)
    later = pending.filter(
        Q(expires_at__gt=after.expires_at) | Q(expires_at=after.expires_at, pk__gt=after.pk)
    ).first()
    return later or pending.first()


# --- expiry, in words -------------------------------------------------------------------


@dataclass(frozen=True)
class Expiry:
    text: str
    soon: bool
    overdue: bool


def duration(seconds: float) -> str:
    """'3 h 12 min', '2 d 4 h', '45 min', 'under a minute' — what a reviewer reads."""
    if seconds < 60:
        return "under a minute"
    minutes = int(seconds // 60)
    days, rest = divmod(minutes, 24 * 60)
    hours, mins = divmod(rest, 60)
    if days:
        return f"{days} d {hours} h" if hours else f"{days} d"
    if hours:
        return f"{hours} h {mins} min" if mins else f"{hours} h"
    return f"{mins} min"


def then_phrase(on_expiry: str, rerequest_count: int) -> str:
    """What the expirer will do (approvals.expiry): the policy's choice, in words."""
    if on_expiry in THEN:
        return THEN[on_expiry]
    if rerequest_count < 1:
        return "then re-requested once, then the run needs attention"
    return "then the run needs attention (it was already re-requested once)"


def expiry_of(expires_at: datetime, on_expiry: str, rerequest_count: int, now: datetime) -> Expiry:
    then = then_phrase(on_expiry, rerequest_count)
    left = (expires_at - now).total_seconds()
    if left <= 0:
        return Expiry(f"expired {duration(-left)} ago — {then} at the next sweep", True, True)
    return Expiry(f"expires in {duration(left)} — {then}", left < 3600, False)


# --- the inbox --------------------------------------------------------------------------


@dataclass(frozen=True)
class Card:
    request: ApprovalRequest
    expiry: Expiry
    mine: bool


@dataclass
class Filters:
    tool: str = ""
    policy: int | None = None
    mine: bool = False

    @classmethod
    def parse(cls, params: QueryDict) -> Filters:
        """Filters from the query string; an unknown value is ignored, not an empty list."""
        policy = params.get("policy", "")
        return cls(
            tool=params.get("tool", "").strip()[:100],
            policy=int(policy) if policy.isdigit() else None,
            mine=params.get("mine") == "1",
        )

    def q(self, deciding: Deciding) -> Q:
        q = Q()
        if self.tool:
            q &= Q(shown__tool=self.tool)
        if self.policy is not None:
            q &= Q(policy_id=self.policy)
        if self.mine:
            q &= deciding.q()
        return q

    def query(self) -> str:
        parts = QueryDict(mutable=True)
        if self.tool:
            parts["tool"] = self.tool
        if self.policy is not None:
            parts["policy"] = str(self.policy)
        if self.mine:
            parts["mine"] = "1"
        return parts.urlencode()

    @property
    def active(self) -> bool:
        return bool(self.tool or self.policy is not None or self.mine)


def _inbox_context(principal: Principal, filters: Filters) -> dict[str, Any]:
    """Cards, counts, filter choices and the reconciliation queue: a fixed number of queries
    however many requests wait (the list is polled every 5 s by every open inbox)."""
    pairs = _pending_pairs(principal)
    deciding = Deciding.of(principal, {(pid, esc) for pid, _, esc, _ in pairs})
    mine_q = deciding.q()
    pending = _pending(principal)
    counts = pending.aggregate(
        total=Count("pk"),
        mine=Count("pk", filter=mine_q),
        shown=Count("pk", filter=filters.q(deciding)) if filters.active else Count("pk"),
    )
    cards_qs = (
        pending.filter(filters.q(deciding))
        .select_related("policy")
        .only(*CARD_FIELDS)
        .annotate(
            initiator=KT("shown__initiator"),
            impact=KT("shown__impact"),
            target=KT("shown__target"),
            tool=KT("shown__tool"),
            mine=ExpressionWrapper(mine_q, output_field=BooleanField())
            if deciding.anything
            else Value(False),
        )
        .order_by("expires_at", "pk")[:INBOX_LIMIT]
    )
    now = timezone.now()
    cards = [
        Card(
            r,
            expiry_of(r.expires_at, r.policy.on_expiry, r.rerequest_count, now),
            bool(r.mine),  # type: ignore[attr-defined]
        )
        for r in cards_qs
    ]
    parked = actions_for(principal).filter(status=ActionStatus.MANUAL_REVIEW)
    first = cards[0].request if cards else None
    query = filters.query()
    return {
        "cards": cards,
        "counts": counts,
        "filters": filters,
        "tools": sorted({tool for *_, tool in pairs if tool}),
        "policies": sorted({(pid, name) for pid, name, _, _ in pairs}, key=lambda p: p[1]),
        "parked": parked.only("action_id", "run_id", "tool", "target", "created_at").order_by(
            "-created_at", "-action_id"
        )[:RECONCILE_LIMIT],
        "parked_count": parked.count(),
        "list_url": reverse("inbox-list") + (f"?{query}" if query else ""),
        "next_url": reverse("approval-page", args=[first.pk]) if first else "",
    }


@login_required
@require_http_methods(["GET"])
def inbox(request: HttpRequest) -> HttpResponse:
    """Pending hold points of the current tenant, soonest expiry first, and what waits for
    reconciliation."""
    principal = _principal(request)
    if principal is None:
        return render(request, "approvals/inbox.html", {})
    context = _inbox_context(principal, Filters.parse(request.GET))
    response = render(request, "approvals/inbox.html", context)
    patch_vary_headers(response, ("HX-Request",))
    return response


@login_required
@require_http_methods(["GET"])
def inbox_list(request: HttpRequest) -> HttpResponse:
    """The part of the inbox htmx polls every 5 s. Opened directly (not by htmx) it answers
    the whole page, so the URL is never a bare fragment in a browser tab."""
    principal = _principal(request)
    if not getattr(request, "htmx", False) or principal is None:
        return inbox(request)
    context = _inbox_context(principal, Filters.parse(request.GET))
    response = render(request, "approvals/_inbox_list.html", context)
    patch_vary_headers(response, ("HX-Request",))
    return response


@login_required
@require_http_methods(["GET"])
def history(request: HttpRequest) -> HttpResponse:
    """Decided requests (any end state), newest first, with who decided and why."""
    principal = _principal(request)
    if principal is None:
        return render(request, "approvals/history.html", {})
    decided = (
        approvals_for(principal)
        .filter(status__in=DECIDED)
        .select_related("policy", "decided_by")
        .only(
            "id",
            "title",
            "run",
            "status",
            "decision_reason",
            "decided_at",
            "updated_at",
            "edits",
            "policy__name",
            "decided_by__username",
        )
        .annotate(closed_at=Coalesce("decided_at", "updated_at"), tool=KT("shown__tool"))
        .order_by("-closed_at", "-pk")  # pk breaks ties so pages never overlap
    )
    page = Paginator(decided, PAGE_SIZE).get_page(request.GET.get("page"))
    return render(request, "approvals/history.html", {"page_obj": page})


# --- one request: params as a form from the tool's schema --------------------------------


@dataclass
class ParamField:
    """One input of the params form; `kind` picks the widget."""

    name: str
    kind: str  # text, textarea, integer, number, checkbox, select, json
    value: str
    checked: bool
    editable: bool
    required: bool
    description: str = ""
    choices: list[str] = field(default_factory=list)
    attrs: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    present: bool = True


def _kind(spec: dict[str, Any], value: Any) -> str:
    if "enum" in spec:
        return "select"
    kind = spec.get("type")
    if kind is None:  # a schema without this property: infer from the value
        kind = {bool: "boolean", int: "integer", float: "number", str: "string"}.get(
            type(value), "json"
        )
    if kind == "boolean":
        return "checkbox"
    if kind in ("integer", "number"):
        return kind
    if kind == "string":
        long_ = int(spec.get("maxLength", SHORT_TEXT + 1)) > SHORT_TEXT
        return "textarea" if long_ or "\n" in str(value or "") else "text"
    return "json"


def _shown_value(kind: str, value: Any) -> str:
    if value is None:
        return ""
    if kind == "json":
        return pretty(value)
    if kind == "checkbox":
        return ""
    return str(value)


def property_order(shown: dict[str, Any], props: dict[str, Any]) -> list[str]:
    """The order the tool declares its properties in.

    `shown` is stored as JSON, and PostgreSQL's jsonb keeps object keys sorted its own way
    (shortest first), so the stored schema cannot tell the order. The registered tool of
    the same version can; a tool no longer registered gets required fields first, then the
    rest alphabetically — the same on every database.
    """
    try:
        tool = get_tool(str(shown.get("tool", "")))
    except InvalidParams:
        tool = None
    if tool is not None and tool.version == shown.get("tool_version"):
        declared = [n for n in tool.schema.get("properties", {}) if n in props]
        return declared + sorted(n for n in props if n not in declared)
    required = [n for n in (shown.get("schema") or {}).get("required", ()) if n in props]
    return required + sorted(n for n in props if n not in required)


def param_fields(
    shown: dict[str, Any],
    params: dict[str, Any],
    *,
    enabled: bool,
    drafts: dict[str, str] | None = None,
    errors: dict[str, list[str]] | None = None,
) -> list[ParamField]:
    """An input per schema property (then any param the schema does not name), in the
    tool's order; editable ones enabled when the user may decide, the others read-only."""
    schema = shown.get("schema") or {}
    props: dict[str, Any] = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    editable = set(shown.get("editable") or ())
    names = property_order(shown, props) + [n for n in params if n not in props]
    fields: list[ParamField] = []
    for name in names:
        spec = props.get(name) or {}
        value = params.get(name)
        kind = _kind(spec, value)
        attrs = {
            k: spec[k]
            for k in ("minLength", "maxLength", "minimum", "maximum")
            if isinstance(spec.get(k), int | float)
        }
        draft = (drafts or {}).get(name)
        fields.append(
            ParamField(
                name=name,
                kind=kind,
                value=draft if draft is not None else _shown_value(kind, value),
                checked=value is True,
                editable=enabled and name in editable,
                required=name in required,
                description=str(spec.get("description", "")),
                choices=[str(c) for c in spec.get("enum", ())],
                attrs=attrs,
                error="; ".join((errors or {}).get(name, ())),
                present=name in params,
            )
        )
    return fields


_MISSING = object()


def _coerce(kind: str, raw: str | None) -> Any:
    """A posted value in the schema's type; ValueError with a reviewer-readable message."""
    if kind == "checkbox":
        return raw is not None
    text = (raw or "").replace("\r\n", "\n")  # browsers send textarea lines as CRLF
    if kind == "integer":
        try:
            return int(text)
        except ValueError:
            raise ValueError("must be a whole number") from None
    if kind == "number":
        try:
            number = float(text)
        except ValueError:
            raise ValueError("must be a number") from None
        return int(number) if number.is_integer() and "." not in text else number
    if kind == "json":
        try:
            return parse_strict(text)
        except CanonicalError as exc:
            raise ValueError(f"is not valid JSON: {exc}") from None
    return text


def edits_from(
    post: QueryDict, shown: dict[str, Any], params: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The fields the reviewer changed (and only those), plus the raw drafts to re-show.

    Non-editable fields are disabled in the form, so a browser never sends them; one that
    arrives anyway and differs is passed on, and `decide` refuses it (field_not_editable).
    """
    edits: dict[str, Any] = {}
    drafts: dict[str, str] = {}
    errors: dict[str, list[str]] = {}
    editable = set(shown.get("editable") or ())
    for f in param_fields(shown, params, enabled=True):
        key = f"param-{f.name}"
        if key not in post and not (f.kind == "checkbox" and f.name in editable):
            continue
        raw = post.get(key)
        drafts[f.name] = raw or ""
        try:
            value = _coerce(f.kind, raw)
        except ValueError as exc:
            errors[f.name] = [f"{f.name} {exc}"]
            continue
        before = params.get(f.name, _MISSING)
        if before is _MISSING and value in ("", False):
            continue  # an optional field left empty is not an edit
        if value != before:
            edits[f.name] = value
    if errors:
        raise InvalidParams("some fields could not be read", errors=errors, drafts=drafts)
    return edits, drafts


@dataclass(frozen=True)
class DiffRow:
    name: str
    before: str
    after: str
    changed: bool


def diff_rows(original: dict[str, Any], edited: dict[str, Any], order: list[str]) -> list[DiffRow]:
    """Original vs edited, field by field, in the tool's order (then any other field)."""
    names = [n for n in order if n in original or n in edited]
    names += sorted((set(original) | set(edited)) - set(names))
    rows = []
    for name in names:
        before, after = original.get(name, _MISSING), edited.get(name, _MISSING)
        rows.append(DiffRow(name, _diff_text(before), _diff_text(after), before != after))
    return rows


def _diff_text(value: Any) -> str:
    if value is _MISSING:
        return ""
    return value if isinstance(value, str) else pretty(value)


# --- one request: the page --------------------------------------------------------------


def _history_rows(principal: Principal, found: ApprovalRequest) -> list[TimelineRow]:
    """The journal entries of this request's action (requested, edited, decided, sent…)."""
    entries = (
        journal_for(principal)
        .filter(stream=run_stream(found.run_id))
        .filter(Q(payload__action_id=str(found.action_id)) | Q(payload__approval_id=str(found.pk)))
        .order_by("-seq")[:HISTORY_LIMIT]
    )
    return [TimelineRow(e, summarise(e.payload), pretty(e.payload)) for e in entries]


def _why_not(
    principal: Principal, found: ApprovalRequest, permitted: bool, voted: bool, now: datetime
) -> str:
    """Why no decision forms are shown (display only: `decide` is the authority)."""
    if found.status != A.PENDING:
        return ""
    if not permitted:
        return "You may look at this request; deciding needs a reviewer granted on its policy."
    if found.policy.separation_of_duties and found.run.created_by == principal.label:
        return "You started this run: someone else must decide its actions."
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
    following = _next_pending(principal, _deciding(principal), found)
    tool = shown.get("tool", found.action.tool)
    similar = (
        approvals_for(principal)
        .filter(shown__tool=tool, status__in=(A.APPROVED, A.REJECTED))
        .exclude(pk=found.pk)
        .select_related("decided_by")
        .only("id", "title", "status", "decided_at", "decision_reason", "decided_by__username")
        .order_by(F("decided_at").desc(nulls_last=True), "-pk")[:SIMILAR_LIMIT]
    )
    newer = (
        None
        if pending
        else _pending(principal).filter(run_id=found.run_id).only("id", "title").first()
    )
    return {
        "req": found,
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
        "expiry": expiry_of(found.expires_at, found.policy.on_expiry, found.rerequest_count, now)
        if pending
        else None,
        "can_decide": can_decide,
        "why_not": why_not,
        "votes": votes,
        "action_changed": action_changed,
        "current_action_params": pretty(json.loads(found.action.params)) if action_changed else "",
        "similar": similar,
        "newer": newer,
        "history": _history_rows(principal, found),
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


@login_required
@require_http_methods(["GET"])
def request_page(request: HttpRequest, request_id: UUID) -> HttpResponse:
    """Everything the reviewer is shown, the params as a form, and the decision forms."""
    principal = _principal(request)
    if principal is None:
        return render(request, "approvals/request.html", {})
    return _render_request(request, principal, _scoped_request(principal, request_id))


@login_required
@require_http_methods(["GET"])
def request_status(request: HttpRequest, request_id: UUID) -> HttpResponse:
    """The status line htmx polls on the request page: the countdown, and a notice when the
    request changed or was decided elsewhere since the page was loaded."""
    principal = _principal(request)
    found = _scoped_request(principal, request_id)
    now = timezone.now()
    context = {
        "req": found,
        "status_url": _status_url(found),
        "stale": request.GET.get("seen", "") != _seen_token(found),
        "expiry": expiry_of(found.expires_at, found.policy.on_expiry, found.rerequest_count, now)
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


def refusal_text(exc: HoldpointError, found: ApprovalRequest) -> str:
    """What a reviewer is told when `decide` refused; nothing was recorded in every case."""
    if isinstance(exc, HashMismatch):
        return (
            "This request changed since you opened it — here is the current version. "
            f"Nothing was recorded; check it again before you decide ({exc.detail})."
        )
    if isinstance(exc, AlreadyDecided):
        return f"Nothing was recorded: {exc.detail}."
    if isinstance(exc, Expired):
        then = then_phrase(found.policy.on_expiry, found.rerequest_count)
        return f"Nothing was recorded: this request {exc.detail} — {then}."
    if isinstance(exc, NotPermitted):
        return f"Not permitted: {exc.detail}. Nothing was recorded."
    return exc.detail


def _done_text(found: ApprovalRequest, decision: str, edits: dict[str, Any] | None) -> str:
    if found.status == A.PENDING:
        given = found.votes.filter(decision=Decision.APPROVE).count()
        return f"Your approval is recorded ({given} of {found.quorum} needed): {found.title}."
    if decision == Decision.REJECT:
        return f"Rejected: {found.title}. The run goes on without it."
    if edits:
        return f"Approved with your edits ({', '.join(sorted(edits))}): {found.title}."
    return f"Approved: {found.title}. The run is queued to send it."


@login_required
@require_http_methods(["POST"])
@decision_rate_limited
def decide_page(request: HttpRequest, request_id: UUID) -> HttpResponse:
    """Hand the reviewer's decision to `decide`; then on to the next item of the inbox."""
    principal = _principal(request)
    found = _scoped_request(principal, request_id)  # 404 first: no oracle for other tenants
    assert principal is not None  # _scoped_request raised 404 otherwise
    if not may_decide(request.user, found.policy, escalated=found.escalated):
        raise PermissionDenied("You may look at this request, not decide it.")
    decision = request.POST.get("decision", "")
    reason, preset, note = _reason(request.POST, decision)
    params = json.loads(found.edited_params or found.params)
    drafts: dict[str, str] = {"__reason": note, "__preset": preset}
    edits: dict[str, Any] | None = None
    try:
        if request.POST.get("mode") == "edit" and decision == Decision.APPROVE:
            edits, field_drafts = edits_from(request.POST, found.shown or {}, params)
            drafts.update(field_drafts)
        decided = decide(
            found.pk,
            request.user,
            decision,
            request.POST.get("action_hash", ""),
            reason=reason,
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
    except HoldpointError as exc:
        messages.error(request, refusal_text(exc, found), extra_tags=exc.code)
        return redirect("approval-page", request_id=found.pk)
    messages.success(request, _done_text(decided, decision, edits))
    following = _next_pending(principal, _deciding(principal), decided)
    if following is None:
        return redirect("inbox")
    return redirect("approval-page", request_id=following.pk)
