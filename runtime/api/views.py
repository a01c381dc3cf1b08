"""The agent API (API.md): thin views over the domain functions.

Views parse, scope to the principal's tenant (another tenant's object is 404), call one
domain function and render. They decide nothing.
"""

from __future__ import annotations

from typing import Any

from django.http import StreamingHttpResponse
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers as drf_serializers
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response

from runtime import lifecycle, outcomes, protocol
from runtime.api import examples as ex
from runtime.api import filters, sse, streams
from runtime.api import serializers as s
from runtime.api.base import ApiView, Cursor, wait_for_change, wait_seconds
from runtime.api.idempotency import idempotent, settler
from runtime.auth import Standing
from runtime.errors import NotPermitted
from runtime.models import Action, Checkpoint, Role, Run
from runtime.tenancy import actions_for, checkpoints_for, journal_for, runs_for


def page_of(serializer: type[Any], name: str) -> Any:
    """The documented shape of a cursor page of `serializer` items."""
    return inline_serializer(
        name=name,
        fields={
            "next": drf_serializers.URLField(allow_null=True),
            "previous": drf_serializers.URLField(allow_null=True),
            "results": serializer(many=True),
        },
    )


def _valid(serializer_class: type[Any], data: Any) -> dict[str, Any]:
    serializer = serializer_class(data=data)
    serializer.is_valid(raise_exception=True)
    return dict(serializer.validated_data)


class RunList(ApiView):
    @extend_schema(
        operation_id="runs_list",
        responses=page_of(s.RunSerializer, "RunPage"),
        parameters=filters.parameters(filters.RunFilter),
    )
    def get(self, request: Request) -> Response:
        runs = filters.apply(filters.RunFilter, request, runs_for(self.principal(request)))
        paginator = Cursor()
        page = paginator.paginate_queryset(runs, request, view=self)
        return paginator.get_paginated_response(s.RunSerializer(page, many=True).data)

    @extend_schema(
        request=s.RunCreate,
        examples=[ex.CREATE_RUN, ex.CREATE_EXTERNAL_RUN],
        responses={201: s.RunSerializer},
    )
    @idempotent
    def post(self, request: Request) -> Response:
        principal = self.principal(request)
        if principal.role == Role.VIEWER:
            raise NotPermitted("viewers may look, not act")
        data = _valid(s.RunCreate, request.data)
        run = lifecycle.create_run(
            principal.tenant,
            data["graph"],
            data["goal"],
            actor=self.actor(request),
            thread_id=data.get("thread_id"),
            graph_version=data.get("graph_version"),
            external=data["external"],
            executor_account=principal.user if principal.is_agent else None,
            settle=settler(request),
        )
        return Response(s.RunSerializer(run).data, status=status.HTTP_201_CREATED)

    def effect_response(self, request: Request, effect: str, created: bool) -> Response:
        """The answer for the run a request with this Idempotency-Key made (it died before
        its response was stored): the run as it is now."""
        run = runs_for(self.principal(request)).get(pk=effect)
        return Response(s.RunSerializer(run).data, status=status.HTTP_201_CREATED)


class RunDetail(ApiView):
    @extend_schema(responses=s.RunSerializer)
    def get(self, request: Request, run_id: str) -> Response:
        run = self.scoped(request, runs_for(self.principal(request)), run_id=run_id)
        seconds = wait_seconds(request)
        if seconds:
            run = wait_for_change(
                lambda: Run.objects.get(pk=run.pk),
                seconds,
                lambda r: (r.status, r.checkpoint_rev, r.goal_rev),
            )
        return Response(s.RunSerializer(run).data)


class RunLever(ApiView):
    """POST levers on one run: revisions, input, cancel, resume."""

    def run(self, request: Request, run_id: str) -> Run:
        principal = self.principal(request)
        run = self.scoped(request, runs_for(principal), run_id=run_id)
        if principal.role == Role.VIEWER:
            raise NotPermitted("viewers may look, not act")
        return run

    def executed(self, request: Request, run_id: str) -> Run:
        """The run for an executor-protocol call: only its executor account, on an external
        run (runtime.protocol.authorize: 409 not_external, 403 not_permitted)."""
        run = self.run(request, run_id)
        protocol.authorize(run, self.principal(request))
        return run


class Revisions(RunLever):
    @extend_schema(request=s.RevisionIn, examples=[ex.REVISE], responses=s.RunSerializer)
    def post(self, request: Request, run_id: str) -> Response:
        run = self.run(request, run_id)
        data = _valid(s.RevisionIn, request.data)
        run = lifecycle.revise_goal(
            run, data["goal"], data["expected_goal_rev"], actor=self.actor(request)
        )
        return Response(s.RunSerializer(run).data)


class Input(RunLever):
    @extend_schema(request=s.InputIn, responses=s.RunSerializer)
    def post(self, request: Request, run_id: str) -> Response:
        run = self.run(request, run_id)
        data = _valid(s.InputIn, request.data)
        run = lifecycle.provide_input(
            run, data["data"], data["expected_rev"], actor=self.actor(request)
        )
        return Response(s.RunSerializer(run).data)


class Cancel(RunLever):
    @extend_schema(request=s.CancelIn, responses=s.RunSerializer)
    def post(self, request: Request, run_id: str) -> Response:
        run = self.run(request, run_id)
        data = _valid(s.CancelIn, request.data)
        run = lifecycle.cancel_run(run, data["reason"], actor=self.actor(request))
        return Response(s.RunSerializer(run).data)


class Resume(RunLever):
    @extend_schema(request=s.ResumeIn, responses={202: s.RunSerializer})
    def post(self, request: Request, run_id: str) -> Response:
        run = self.run(request, run_id)
        data = _valid(s.ResumeIn, request.data)
        run = lifecycle.resume_run(
            run, actor=self.actor(request), expected_rev=data.get("expected_rev")
        )
        return Response(s.RunSerializer(run).data, status=status.HTTP_202_ACCEPTED)


class Checkpoints(RunLever):
    @extend_schema(
        operation_id="runs_checkpoints_list",
        responses=page_of(s.CheckpointSerializer, "CheckpointPage"),
        parameters=filters.parameters(None),
    )
    def get(self, request: Request, run_id: str) -> Response:
        run = self.scoped(request, runs_for(self.principal(request)), run_id=run_id)
        checkpoints = checkpoints_for(self.principal(request)).filter(run=run)
        paginator = Cursor()
        paginator.ordering = "-rev"
        page = paginator.paginate_queryset(checkpoints, request, view=self)
        return paginator.get_paginated_response(s.CheckpointSerializer(page, many=True).data)

    @extend_schema(
        request=s.CheckpointIn, examples=[ex.CHECKPOINT], responses={201: s.CheckpointSerializer}
    )
    @idempotent
    def post(self, request: Request, run_id: str) -> Response:
        run = self.executed(request, run_id)
        data = _valid(s.CheckpointIn, request.data)
        checkpoint = protocol.write_checkpoint(
            run,
            data["fence"],
            data["expected_rev"],
            data["state"],
            data["next_step"],
            self.actor(request),
            status=data["status"],
            prompt=data["prompt"],
            settle=settler(request),
        )
        return Response(s.CheckpointSerializer(checkpoint).data, status=status.HTTP_201_CREATED)

    def effect_response(
        self, request: Request, effect: str, created: bool, run_id: str
    ) -> Response:
        """The answer for the checkpoint (its rev) a request with this key wrote."""
        principal = self.principal(request)
        checkpoint = checkpoints_for(principal).get(run_id=run_id, rev=int(effect))
        return Response(s.CheckpointSerializer(checkpoint).data, status=status.HTTP_201_CREATED)


class CheckpointDetail(ApiView):
    @extend_schema(responses=s.CheckpointSerializer)
    def get(self, request: Request, run_id: str, rev: int) -> Response:
        principal = self.principal(request)
        run = self.scoped(request, runs_for(principal), run_id=run_id)
        checkpoint: Checkpoint = self.scoped(request, checkpoints_for(principal), run=run, rev=rev)
        data = s.CheckpointSerializer(checkpoint).data
        if request.query_params.get("inline") in ("1", "true"):
            from runtime.artifacts import resolve

            data["state"] = resolve(run.tenant_id, checkpoint.state)
        return Response(data)


class Events(streams.StreamingList):
    @extend_schema(
        operation_id="runs_events_list",
        responses={
            (200, "application/json"): inline_serializer(
                name="EventList", fields={"results": s.JournalEntrySerializer(many=True)}
            ),
            (200, "text/event-stream"): streams.EVENT_STREAM,
        },
        parameters=[
            OpenApiParameter("after", int, description="only entries after this seq"),
            *streams.PARAMETERS,
        ],
        description=streams.DESCRIPTION,
    )
    def get(self, request: Request, run_id: str) -> Response | StreamingHttpResponse:
        principal = self.principal(request)
        run = self.scoped(request, runs_for(principal), run_id=run_id)
        after = streams.after(request, 0)
        if streams.requested(request):
            after = streams.resume_after(request, after)
            standing = Standing.of(request, principal)
            if sse.iterates(request._request):
                events_now = streams.run_events_now(principal, run.pk, after, standing)
                return streams.opened(principal, events_now, follow=False)
            follow = sse.follows(request._request)
            events = streams.run_events(principal, run.pk, after, follow=follow, standing=standing)
            return streams.opened(principal, events, follow=follow)
        entries = journal_for(principal).filter(stream=f"run:{run.pk}", seq__gt=after)
        entries = entries.order_by("seq")[:500]
        return Response({"results": s.JournalEntrySerializer(entries, many=True).data})


class RunActions(RunLever):
    @extend_schema(
        operation_id="runs_actions_list",
        responses=page_of(s.ActionSerializer, "RunActionPage"),
        parameters=filters.parameters(None),
    )
    def get(self, request: Request, run_id: str) -> Response:
        run = self.scoped(request, runs_for(self.principal(request)), run_id=run_id)
        actions = actions_for(self.principal(request)).filter(run=run).select_related("run")
        paginator = Cursor()
        page = paginator.paginate_queryset(actions, request, view=self)
        return paginator.get_paginated_response(s.ActionSerializer(page, many=True).data)

    @extend_schema(
        request=s.ActionIn,
        examples=[ex.PREPARE],
        # 200: the same idempotency_key with the same params finds the action prepared before.
        responses={201: s.ActionSerializer, 200: s.ActionSerializer},
    )
    @idempotent
    def post(self, request: Request, run_id: str) -> Response:
        run = self.executed(request, run_id)
        data = _valid(s.ActionIn, request.data)
        action, created = protocol.prepare(
            run,
            data["fence"],
            data["tool"],
            data["params"],
            reason=data["reason"],
            who=self.actor(request),
            idempotency_key=data.get("idempotency_key"),
            target=data["target"],
            expected_goal_rev=data.get("expected_goal_rev"),
            settle=settler(request),
        )
        return self.effect_response(request, action.pk, created, run_id)

    def effect_response(
        self, request: Request, effect: Any, created: bool, run_id: str
    ) -> Response:
        """The answer for the action a request with this key prepared or found."""
        action = actions_for(self.principal(request)).select_related("run").get(pk=effect)
        return Response(
            s.ActionSerializer(action).data,
            status=status.HTTP_201_CREATED if created else status.HTTP_200_OK,
        )


class Lease(RunLever):
    @extend_schema(request=s.LeaseIn, examples=[ex.LEASE], responses=s.LeaseOut)
    def post(self, request: Request, run_id: str) -> Response:
        run = self.executed(request, run_id)
        data = _valid(s.LeaseIn, request.data)
        lease = protocol.take(run, data["owner"], data["ttl_seconds"], who=self.actor(request))
        return Response(
            {"fence": lease.fence, "expires_at": lease.expires_at, "owner": lease.owner}
        )


class Heartbeat(RunLever):
    @extend_schema(request=s.HeartbeatIn, responses=s.HeartbeatOut)
    def post(self, request: Request, run_id: str) -> Response:
        run = self.executed(request, run_id)
        data = _valid(s.HeartbeatIn, request.data)
        expires = protocol.heartbeat(
            run,
            data["fence"],
            data["ttl_seconds"],
            who=self.actor(request),
            owner=data.get("owner"),
        )
        return Response({"expires_at": expires, "fence": data["fence"]})


class Release(RunLever):
    @extend_schema(request=s.ReleaseIn, responses=s.ReleaseOut)
    def post(self, request: Request, run_id: str) -> Response:
        run = self.executed(request, run_id)
        data = _valid(s.ReleaseIn, request.data)
        protocol.release(run, data["fence"], self.actor(request), owner=data.get("owner"))
        return Response({"released": True, "fence": data["fence"]})


class Actions(ApiView):
    @extend_schema(
        operation_id="actions_list",
        responses=page_of(s.ActionSerializer, "ActionPage"),
        parameters=filters.parameters(filters.ActionFilter),
    )
    def get(self, request: Request) -> Response:
        actions = filters.apply(
            filters.ActionFilter, request, actions_for(self.principal(request))
        ).select_related("run")
        paginator = Cursor()
        page = paginator.paginate_queryset(actions, request, view=self)
        return paginator.get_paginated_response(s.ActionSerializer(page, many=True).data)


class ActionLever(ApiView):
    def scoped_action(self, request: Request, action_id: str) -> Action:
        principal = self.principal(request)
        action = self.scoped(request, actions_for(principal), action_id=action_id)
        if principal.role == Role.VIEWER:
            raise NotPermitted("viewers may look, not act")
        return action

    def executed_action(self, request: Request, action_id: str) -> Action:
        """The action for an executor-protocol call: its run's executor account only."""
        action = self.scoped_action(request, action_id)
        protocol.authorize(action.run, self.principal(request))
        return action


class ActionDetail(ActionLever):
    @extend_schema(responses=s.ActionSerializer)
    def get(self, request: Request, action_id: str) -> Response:
        action = self.scoped(request, actions_for(self.principal(request)), action_id=action_id)
        return Response(s.ActionSerializer(action).data)


class Dispatch(ActionLever):
    @extend_schema(request=s.FenceIn, examples=[ex.DISPATCH], responses=s.ActionSerializer)
    def post(self, request: Request, action_id: str) -> Response:
        action = self.executed_action(request, action_id)
        data = _valid(s.FenceIn, request.data)
        action = protocol.dispatch(action, data["fence"], self.actor(request))
        return Response(s.ActionSerializer(action).data)


class Outcome(ActionLever):
    @extend_schema(request=s.OutcomeIn, examples=[ex.OUTCOME], responses=s.ActionSerializer)
    def post(self, request: Request, action_id: str) -> Response:
        action = self.executed_action(request, action_id)
        data = _valid(s.OutcomeIn, request.data)
        action = protocol.record_outcome(
            action,
            data["fence"],
            data["outcome"],
            who=self.actor(request),
            owner=action.run.lease_owner,
            external_id=data["external_id"],
            result=data["result"],
        )
        return Response(s.ActionSerializer(action).data)


class Resolve(ActionLever):
    @extend_schema(request=s.ResolveIn, examples=[ex.RESOLVE], responses=s.ActionSerializer)
    def post(self, request: Request, action_id: str) -> Response:
        action = self.scoped_action(request, action_id)
        if not self.principal(request).may_act:
            raise NotPermitted("only a reviewer or admin resolves an action")
        data = _valid(s.ResolveIn, request.data)
        action = outcomes.resolve(
            action,
            data["outcome"],
            actor=self.actor(request),
            external_id=data["external_id"],
            note=data["note"],
        )
        return Response(s.ActionSerializer(action).data)
