"""The reviewer pages' queries: the inbox, its history, and what a request page shows
beside the request (the next item, similar past decisions, a newer request, the timeline).

Every query starts from `approvals_for` or the runtime tenancy helpers, so another tenant's
rows are never in them. Who may decide a card is computed here for display (`Deciding`);
`decide` checks all of it again under row locks. The counts and cards are a fixed number
of queries however many requests wait (issue 8).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django import forms
from django.contrib.auth.models import User
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
from django.http import QueryDict
from django.utils import timezone

from approvals.models import ApprovalPolicy, ApprovalRequest, ApprovalStatus, ApprovalVote
from approvals.policies import may_decide
from approvals.scoping import approvals_for
from approvals.wording import Expiry, expiry_of
from audit.journal import run_stream
from runtime import toolcatalog
from runtime.errors import InvalidParams
from runtime.models import ActionStatus, Run
from runtime.pages import TimelineRow, pretty, summarise
from runtime.tenancy import Principal, actions_for, journal_for, scope

A = ApprovalStatus
DECIDED = (A.APPROVED, A.REJECTED, A.EXPIRED, A.SUPERSEDED, A.CANCELLED)
# The inbox shows the soonest-to-expire this many; the counts still tell the whole truth.
# Rendering the cards is most of the page's time (issue 8: ~0.8 ms a card; 100 cards put
# the p95 of a busy tenant's inbox over 100 ms), and the list is re-fetched every 5 s.
INBOX_LIMIT = 50
RECONCILE_LIMIT = 20
SIMILAR_LIMIT = 5
HISTORY_LIMIT = 50
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


@dataclass(frozen=True)
class Deciding:
    """Which pending requests a user may decide, as a filter the database evaluates.

    Built once per page from `may_decide` per (policy, escalated) pair that has pending
    requests — a handful of queries however many cards there are. Separation of duties and
    "already voted" are mirrored here for display only; `decide` re-checks all of it.
    """

    user: User
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


def pending_for(principal: Principal) -> QuerySet[ApprovalRequest]:
    return approvals_for(principal).filter(status=A.PENDING)


def _pending_pairs(principal: Principal) -> list[tuple[int, str, bool, str]]:
    """(policy id, policy name, escalated, tool) of every pending request, distinct."""
    rows = (
        pending_for(principal)
        .annotate(tool_name=KT("shown__tool"))
        .values_list("policy_id", "policy__name", "escalated", "tool_name")
        .order_by()
        .distinct()
    )
    return list(rows)


def deciding_for(principal: Principal) -> Deciding:
    return Deciding.of(principal, {(pid, esc) for pid, _, esc, _ in _pending_pairs(principal)})


def next_pending(
    principal: Principal, deciding: Deciding, after: ApprovalRequest | None
) -> ApprovalRequest | None:
    """The next item in inbox order (soonest expiry first) after `after`, wrapping round.

    Only requests this user may still decide when they may decide any; otherwise every
    pending one, so a viewer can still page through.
    """
    pending = pending_for(principal).order_by("expires_at", "pk").only("id", "expires_at")
    if deciding.anything:
        pending = pending.filter(deciding.q())
    if after is None:
        return pending.first()
    pending = pending.exclude(pk=after.pk)
    later = pending.filter(
        Q(expires_at__gt=after.expires_at) | Q(expires_at=after.expires_at, pk__gt=after.pk)
    ).first()
    return later or pending.first()


# --- the inbox ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Card:
    request: ApprovalRequest
    expiry: Expiry
    mine: bool
    server_off: str = ""  # its tool's MCP server, inactive now: approving sends nothing yet


class InboxFilterForm(forms.Form):
    tool = forms.CharField(max_length=100, required=False)
    # Ids are positive and fit PostgreSQL's `integer` (SQLite overflows past 2**63 - 1).
    policy = forms.IntegerField(min_value=1, max_value=2**31 - 1, required=False)
    mine = forms.ChoiceField(choices=[("", "any"), ("1", "mine to decide")], required=False)


@dataclass
class Filters:
    tool: str = ""
    policy: int | None = None
    mine: bool = False

    @classmethod
    def parse(cls, params: QueryDict) -> Filters:
        """Filters from the query string, validated by a Django form: `policy=²` (a digit to
        `str.isdigit`, not to `int`), an id past the database's integer range and a NUL in
        `tool` are InvalidParams naming the field (a 400 page), never a 500 (issue 16, L1)."""
        form = InboxFilterForm(params)
        if not form.is_valid():
            errors = {name: [str(m) for m in msgs] for name, msgs in form.errors.items()}
            raise InvalidParams(f"invalid inbox filter: {', '.join(sorted(errors))}", errors=errors)
        data = form.cleaned_data
        return cls(tool=data["tool"], policy=data["policy"], mine=data["mine"] == "1")

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


def inbox_context(principal: Principal, filters: Filters) -> dict[str, Any]:
    """Cards, counts, filter choices and the reconciliation queue: a fixed number of queries
    however many requests wait (the list is polled every 5 s by every open inbox). The
    page's URLs are the view's to add."""
    pairs = _pending_pairs(principal)
    deciding = Deciding.of(principal, {(pid, esc) for pid, _, esc, _ in pairs})
    mine_q = deciding.q()
    pending = pending_for(principal)
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
            graph=KT("shown__graph"),  # what its last expiry does is the graph's (wording)
            undoes=KT("shown__compensates__idempotency_key"),  # a compensation's (wording)
            mine=ExpressionWrapper(mine_q, output_field=BooleanField())
            if deciding.anything
            else Value(False),
        )
        .order_by("expires_at", "pk")[:INBOX_LIMIT]
    )
    now = timezone.now()
    # Whose tool is an inactive MCP server's, for every pending tool at once (two statements
    # at most, however many cards): the card says approving will not send it yet.
    off = toolcatalog.withheld_by_name(principal.tenant.pk, {tool for *_, tool in pairs if tool})
    cards = [
        Card(
            r,
            expiry_of(
                r.expires_at,
                r.policy.on_expiry,
                r.rerequest_count,
                now,
                graph=r.graph or "",
                undo=bool(r.undoes),
            ),
            bool(r.mine),
            off.get(r.tool or "", ""),
        )
        for r in cards_qs
    ]
    parked = actions_for(principal).filter(status=ActionStatus.MANUAL_REVIEW)
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
    }


def decided_requests(principal: Principal) -> QuerySet[ApprovalRequest]:
    """Decided requests (any end state), newest first, with who decided and why."""
    return (
        approvals_for(principal)
        .filter(status__in=DECIDED)
        .select_related("policy", "decided_by")
        .only(
            "id",
            "title",
            "run",
            "status",
            "decision_reason",
            "closed_reason",
            "decided_at",
            "updated_at",
            "edits",
            "policy__name",
            "decided_by__username",
        )
        .annotate(closed_at=Coalesce("decided_at", "updated_at"), tool=KT("shown__tool"))
        .order_by("-closed_at", "-pk")  # pk breaks ties so pages never overlap
    )


# --- beside one request -------------------------------------------------------------------


def similar_decisions(
    principal: Principal, tool: str, found: ApprovalRequest
) -> QuerySet[ApprovalRequest]:
    """The last few decisions on actions of the same tool (what others did before)."""
    return (
        approvals_for(principal)
        .filter(shown__tool=tool, status__in=(A.APPROVED, A.REJECTED))
        .exclude(pk=found.pk)
        .select_related("decided_by")
        .only("id", "title", "status", "decided_at", "decision_reason", "decided_by__username")
        .order_by(F("decided_at").desc(nulls_last=True), "-pk")[:SIMILAR_LIMIT]
    )


def newer_request(principal: Principal, found: ApprovalRequest) -> ApprovalRequest | None:
    """The run's open request now, when this one is closed (re-requested, superseded)."""
    return pending_for(principal).filter(run_id=found.run_id).only("id", "title").first()


def request_timeline(principal: Principal, found: ApprovalRequest) -> list[TimelineRow]:
    """The journal entries of this request's action (requested, edited, decided, sent…)."""
    entries = (
        journal_for(principal)
        .filter(stream=run_stream(found.run_id))
        .filter(Q(payload__action_id=str(found.action_id)) | Q(payload__approval_id=str(found.pk)))
        .order_by("-seq")[:HISTORY_LIMIT]
    )
    return [TimelineRow(e, summarise(e.payload), pretty(e.payload)) for e in entries]
