"""Approvals over the API (API.md, "Approvals and manual reconciliation")."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterator
from functools import partial
from typing import Any

import django_filters
from django.db import DatabaseError
from django.http import StreamingHttpResponse
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response

from approvals.decisions import decide
from approvals.models import ApprovalRequest, ApprovalStatus
from approvals.scoping import approvals_for
from audit import journal
from audit.models import StreamHead
from runtime import live
from runtime.api import filters, sse, streams
from runtime.api.base import ApiView, Cursor, wait_for_change, wait_seconds
from runtime.api.examples import DECIDE
from runtime.api.serializers import StrictChar
from runtime.api.views import page_of
from runtime.auth import Standing
from runtime.models.limits import NOTE_MAX
from runtime.tenancy import Principal, journal_for

log = logging.getLogger(__name__)


class ApprovalSerializer(serializers.ModelSerializer[ApprovalRequest]):
    run_id = serializers.UUIDField(source="run.run_id", read_only=True)
    action = serializers.SerializerMethodField()
    decided_by = serializers.SerializerMethodField()
    edits = serializers.JSONField()

    class Meta:
        model = ApprovalRequest
        fields = [
            "id",
            "run_id",
            "title",
            "action",
            "action_hash",
            "status",
            "expires_at",
            "quorum",
            "decided_by",
            "decided_at",
            "decision",
            "decision_reason",
            "closed_reason",
            "edits",
            "created_at",
        ]

    def get_action(self, request: ApprovalRequest) -> dict[str, Any]:
        shown = request.shown
        return {
            "action_id": str(request.action_id),
            "tool": shown.get("tool"),
            "params": json.loads(request.edited_params or request.params),
            "target": shown.get("target"),
            "reason": shown.get("reason"),
            "impact": shown.get("impact"),
            "editable": shown.get("editable", []),
        }

    def get_decided_by(self, request: ApprovalRequest) -> str | None:
        return request.decided_by.get_username() if request.decided_by else None


class DecisionIn(serializers.Serializer[Any]):
    decision = serializers.ChoiceField(choices=["approve", "reject"])
    action_hash = StrictChar(max_length=64)
    reason = StrictChar(max_length=NOTE_MAX, allow_blank=True, default="")
    edits = serializers.DictField(required=False)


class ApprovalFilter(django_filters.FilterSet):
    status = django_filters.ChoiceFilter(choices=ApprovalStatus.choices)

    class Meta:
        model = ApprovalRequest
        fields = ["status"]


class Approvals(streams.StreamingList):
    @extend_schema(
        operation_id="approvals_list",
        responses={
            (200, "application/json"): page_of(ApprovalSerializer, "ApprovalPage"),
            (200, "text/event-stream"): streams.EVENT_STREAM,
        },
        parameters=[*filters.parameters(ApprovalFilter), *streams.PARAMETERS, streams.AFTER],
        description=(
            "With `stream=1`: server-sent events (`event: approval`, `id:` a position in the "
            "tenant's approval changes, `data:` the approval as JSON), one each time an "
            "approval of the caller's tenant is created or changes status — after "
            "`Last-Event-ID` (or `after`), else after the stream opened (its first line "
            "`id:` says where that is); with `status`: only when it becomes that status; a "
            "comment line at least every 15 s."
        ),
    )
    def get(self, request: Request) -> Response | StreamingHttpResponse:
        principal = self.principal(request)
        mine = approvals_for(principal)
        # Where a stream resumes: refused when malformed, on the list too (it documents them).
        after = streams.resume_after(request, streams.after(request, None))
        if streams.requested(request):
            # The list's filters hold for the stream too, refused alike when invalid: an
            # event is an approval now in the status asked for.
            filters.apply(ApprovalFilter, request, mine)
            start = changes_head(principal) if after is None else after
            status = request.query_params.get("status")
            standing = Standing.of(request, principal)
            if sse.iterates(request._request):
                events_now = approval_events_now(principal, start, status, standing)
                return streams.opened(principal, events_now, follow=False)
            follow = sse.follows(request._request)
            events = approval_events(
                principal, start, follow=follow, standing=standing, status=status
            )
            return streams.opened(principal, events, follow=follow)
        approvals = filters.apply(ApprovalFilter, request, mine).select_related("run", "decided_by")
        paginator = Cursor()
        page = paginator.paginate_queryset(approvals, request, view=self)
        return paginator.get_paginated_response(ApprovalSerializer(page, many=True).data)


# The approvals stream's events are the tenant stream's entries of this type
# (approvals.requests.announce_status): their seq is the event id.
CHANGED = "approval_status"


def changes_head(principal: Principal) -> int:
    """Where the principal's tenant's approval changes are now: the seq of its stream's head
    (a stream opened without a position starts there)."""
    stream = journal.tenant_stream(principal.tenant.pk)
    head = StreamHead.objects.filter(stream=stream, tenant_id=principal.tenant.pk)
    return head.values_list("seq", flat=True).first() or 0


def _changed(
    principal: Principal, last: int, status: str | None
) -> tuple[list[tuple[int, bytes | None]], bool]:
    """On a reader thread: the tenant's approval changes after `last`, in order — each with
    its event, or None for one not to send: not the status asked for, or no longer the
    approval's status (it moved on since: its later change is sent instead, with the
    approval as it is now, so a change is never sent twice nor an approval shown twice in
    one state) — and whether there may be more."""
    entries = journal_for(principal).filter(
        stream=journal.tenant_stream(principal.tenant.pk), seq__gt=last, type=CHANGED
    )
    changes = list(entries.order_by("seq").values_list("seq", "payload")[: streams.BATCH])
    ids = {payload.get("approval_id") for _, payload in changes}
    rows = approvals_for(principal).filter(pk__in=ids).select_related("run", "decided_by")
    now = {str(a.pk): a for a in rows}
    render = JSONRenderer().render
    events: list[tuple[int, bytes | None]] = []
    for seq, payload in changes:
        approval = now.get(payload.get("approval_id"))
        said = payload.get("status")
        if approval is None or approval.status != said or status not in (None, said):
            events.append((seq, None))
            continue
        data = render(ApprovalSerializer(approval).data)
        events.append((seq, live.event(data, type="approval", id=seq)))
    return events, len(changes) == streams.BATCH


class _Told:
    """Where an approvals stream is: the last change read (`last`) and the last id the
    client was told (`told`), which an `id:` line alone brings up to `last`."""

    def __init__(self, after: int) -> None:
        self.last = after
        self.told: int | None = None

    def chunks(self, events: list[tuple[int, bytes | None]]) -> list[bytes]:
        sent: list[bytes] = []
        for seq, chunk in events:
            self.last = seq
            if chunk is not None:
                self.told = seq
                sent.append(chunk)
        if self.told != self.last:  # where the next resume starts, though nothing was sent
            self.told = self.last
            sent.append(live.position(self.last))
        return sent


def approval_events_now(
    principal: Principal, after: int, status: str | None, standing: Standing | None = None
) -> Iterator[bytes]:
    """approval_events without `follow`, read batch by batch in the calling thread: a
    stream whose body is iterated synchronously (runtime.api.sse.iterates). A database
    error ends the stream; the client resumes from its last id. It ends between two
    batches once `standing` no longer stands (runtime.api.streams.still_stands)."""
    told = _Told(after)
    while True:
        events, more = _changed(principal, told.last, status)
        yield from told.chunks(events)
        if not more or not streams.still_stands(standing):
            return


async def approval_events(
    principal: Principal,
    after: int,
    *,
    follow: bool = True,
    standing: Standing | None = None,
    status: str | None = None,
) -> AsyncIterator[bytes]:
    """Each approval of the tenant as it is created and as its status changes (only those
    it changes to `status`, if given), after the change `after` — from a position in the
    tenant's stream (`changes_head`, Last-Event-ID), so a client that resumes with the last
    id it saw loses and repeats nothing, however the wake-ups were missed or merged. Where
    to resume is always said: by each event's id, else by an `id:` line alone (no event;
    EventSource and live.js take it as the last id) — at the start, and after changes read
    and not sent.
    Without `follow` (not served on the event loop: runtime.api.sse.follows) it sends the
    changes there are and ends. It also ends once what opened it (`standing`) no longer
    stands (runtime.api.streams.Recheck)."""
    told = _Told(after)
    recheck = streams.Recheck(standing)
    stream = journal.tenant_stream(principal.tenant.pk)
    watch = live.doorbell.subscription(stream) if follow else live.unwatched()
    async with watch as wake:
        while True:
            wake.clear()
            try:
                events, more = await live.doorbell.read(
                    ("approvals", principal.tenant.pk, told.last, status),
                    partial(_changed, principal, told.last, status),
                )
            except DatabaseError:
                live.read_failed(log, "live events: reading approval changes failed; retrying")
                if alive := await recheck.pause():
                    yield alive
                continue
            for chunk in told.chunks(events):
                yield chunk
            if more:
                if not await recheck.between():
                    return
                continue
            if not follow:
                return
            first = await recheck.wait(wake)
            if first is None:
                return
            if first:
                yield first


class ApprovalDetail(ApiView):
    @extend_schema(responses=ApprovalSerializer)
    def get(self, request: Request, approval_id: str) -> Response:
        approval = self.scoped(request, approvals_for(self.principal(request)), id=approval_id)
        seconds = wait_seconds(request)
        if seconds:
            approval = wait_for_change(
                lambda: ApprovalRequest.objects.get(pk=approval.pk),
                seconds,
                lambda a: (a.status, a.action_hash, a.votes.count()),
            )
        return Response(ApprovalSerializer(approval).data)


class Decision(ApiView):
    @extend_schema(request=DecisionIn, examples=[DECIDE], responses=ApprovalSerializer)
    def post(self, request: Request, approval_id: str) -> Response:
        approval = self.scoped(request, approvals_for(self.principal(request)), id=approval_id)
        serializer = DecisionIn(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        decided = decide(
            approval.pk,
            self.principal(request).user,
            data["decision"],
            data["action_hash"],
            reason=data["reason"],
            edits=data.get("edits"),
        )
        return Response(ApprovalSerializer(decided).data)
