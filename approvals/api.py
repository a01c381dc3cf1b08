"""Approvals over the API (API.md, "Approvals and manual reconciliation")."""

from __future__ import annotations

import json
from typing import Any

import django_filters
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from approvals.decisions import decide
from approvals.models import ApprovalRequest, ApprovalStatus
from approvals.scoping import approvals_for
from runtime.api import filters
from runtime.api.base import ApiView, Cursor, wait_for_change, wait_seconds
from runtime.api.examples import DECIDE
from runtime.api.serializers import StrictChar
from runtime.api.views import page_of


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


class Approvals(ApiView):
    @extend_schema(
        operation_id="approvals_list",
        responses=page_of(ApprovalSerializer, "ApprovalPage"),
        parameters=filters.parameters(ApprovalFilter),
    )
    def get(self, request: Request) -> Response:
        approvals = filters.apply(
            ApprovalFilter, request, approvals_for(self.principal(request))
        ).select_related("run", "decided_by")
        paginator = Cursor()
        page = paginator.paginate_queryset(approvals, request, view=self)
        return paginator.get_paginated_response(ApprovalSerializer(page, many=True).data)


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
