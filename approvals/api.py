"""Approvals over the API (API.md, "Approvals and manual reconciliation")."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import datetime
from functools import partial
from typing import Any

import django_filters
from django.db import DatabaseError
from django.db.models import Q
from django.http import StreamingHttpResponse
from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response

from approvals.decisions import decide
from approvals.models import ApprovalRequest, ApprovalStatus
from approvals.scoping import approvals_for
from runtime import live
from runtime.api import filters, sse, streams
from runtime.api.base import ApiView, Cursor, wait_for_change, wait_seconds
from runtime.api.examples import DECIDE
from runtime.api.serializers import StrictChar
from runtime.api.views import page_of
from runtime.auth import Standing
from runtime.tenancy import Principal


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
    reason = StrictChar(max_length=2000, allow_blank=True, default="")
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
        parameters=[*filters.parameters(ApprovalFilter), streams.PARAMETERS[0]],
        description=(
            "With `stream=1`: server-sent events (`event: approval`, `data:` the approval as "
            "JSON), one each time an approval of the caller's tenant is created or changes "
            "status after the stream opened (with `status`: only when it becomes that "
            "status); a comment line at least every 15 s."
        ),
    )
    def get(self, request: Request) -> Response | StreamingHttpResponse:
        principal = self.principal(request)
        mine = approvals_for(principal)
        if streams.requested(request):
            # The list's filters hold for the stream too, refused alike when invalid: an
            # event is an approval now in the status asked for.
            filters.apply(ApprovalFilter, request, mine)
            follow = sse.follows(request._request)
            standing = Standing.of(request, principal)
            events = approval_events(
                principal,
                timezone.now(),
                follow=follow,
                standing=standing,
                status=request.query_params.get("status"),
            )
            return live.response(events)
        approvals = filters.apply(ApprovalFilter, request, mine).select_related("run", "decided_by")
        paginator = Cursor()
        page = paginator.paginate_queryset(approvals, request, view=self)
        return paginator.get_paginated_response(ApprovalSerializer(page, many=True).data)


def _changed(
    principal: Principal, since: datetime, was_pending: list[Any]
) -> list[tuple[Any, str, bool, bytes]]:
    """On a reader thread: the approvals that may have changed since the stream opened —
    those created since (flagged), those pending, and those this stream last saw pending."""
    rows = approvals_for(principal).filter(
        Q(created_at__gte=since) | Q(status=ApprovalStatus.PENDING) | Q(pk__in=was_pending)
    )
    render = JSONRenderer().render
    return [
        (
            a.pk,
            a.status,
            a.created_at >= since,
            live.event(render(ApprovalSerializer(a).data), type="approval"),
        )
        for a in rows.select_related("run", "decided_by")
    ]


async def approval_events(
    principal: Principal,
    since: datetime,
    *,
    follow: bool = True,
    standing: Standing | None = None,
    status: str | None = None,
) -> AsyncIterator[bytes]:
    """Each approval of the tenant as it is created and as its status changes (only those
    it changes to `status`, if given). Every read compares the statuses with the last ones
    seen, so a merged wake-up loses no change.
    Without `follow` (not served on the event loop: runtime.api.sse.follows) it ends at once:
    it shows changes after it opened, and there are none yet. It also ends once what opened
    it (`standing`) no longer stands (runtime.api.streams.Recheck)."""
    if not follow:
        return
    recheck = streams.Recheck(standing)
    known: dict[Any, str] | None = None
    me = object()  # reads are this stream's own (`known` differs per stream)
    async with live.doorbell.subscription(live.tenant_key(principal.tenant.pk)) as wake:
        while True:
            wake.clear()
            was_pending = [pk for pk, s in (known or {}).items() if s == ApprovalStatus.PENDING]
            try:
                rows = await live.doorbell.read(
                    me, partial(_changed, principal, since, was_pending)
                )
            except DatabaseError:
                await asyncio.sleep(live.RETRY_SECONDS)
                continue
            if known is None:  # what there was when the stream opened is not news
                known = {pk: now for pk, now, new, _ in rows if not new}
            for pk, now, _, chunk in rows:
                if known.get(pk) != now and status in (None, now):
                    yield chunk
            # What is read again at the next wake-up: the pending ones, and those created
            # since the stream opened, decided ones too — those are read at every wake-up,
            # and must not be sent again as if they had changed. (Only the pending ones are
            # asked for by id: the list stays as short as the pending approvals.)
            known = {pk: now for pk, now, new, _ in rows if new or now == ApprovalStatus.PENDING}
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
