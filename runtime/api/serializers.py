"""Request and response shapes of the agent API (API.md). They validate and render; the
domain functions decide."""

from __future__ import annotations

import json
from typing import Any

from django.core.validators import RegexValidator
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from runtime.models import Action, Checkpoint, Run
from runtime.models.limits import NOTE_MAX


class StrictInt(serializers.IntegerField):
    """A JSON integer, not a string that looks like one: fences and revisions are compared,
    and "1" silently becoming 1 would hide a client bug."""

    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return int(super().to_internal_value(data))


class StrictChar(serializers.CharField):
    """A JSON string, not a number DRF would turn into one: the schema says `string`, and
    `"reason": 0` stored as "0" is a client bug the caller should hear about (issue 16, L7).

    A field that may not be blank is trimmed first, so `"\n"` is blank to it: the schema
    says so with `pattern: \\S` (some character that is not white space), or a client
    reading `minLength: 1` would send it and be refused (found by schemathesis at 12,000
    cases: `"owner": "\n"`).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not self.allow_blank and self.trim_whitespace:
            self.validators.append(RegexValidator(r"\S", message="This field may not be blank."))

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return str(super().to_internal_value(data))


class StrictBool(serializers.BooleanField):
    """JSON `true` or `false` only: DRF also takes 0, 1, "yes" and "off", which the schema's
    `boolean` does not allow (`"external": 0` made a hosted run, issue 16, L7)."""

    def to_internal_value(self, data: Any) -> bool:
        if not isinstance(data, bool):
            self.fail("invalid", input=data)
        return data


@extend_schema_field(
    {
        "anyOf": [{"type": t} for t in ("object", "array", "string", "number", "boolean")],
        "description": "any JSON value but null",
    }
)
class JSONValue(serializers.JSONField):
    """Any JSON value except null, and the OpenAPI document says so: the goal, a state,
    input data and params are stored in NOT NULL columns, and a typeless schema (`{}`)
    told clients null was fine when the server refused it (issue 16, L7)."""


class LeaseSerializer(serializers.Serializer[dict[str, Any]]):
    owner = serializers.CharField()
    expires_at = serializers.DateTimeField(allow_null=True)
    fence = StrictInt()


class RunSerializer(serializers.ModelSerializer[Run]):
    lease = serializers.SerializerMethodField()
    goal = serializers.JSONField()
    waiting_for = serializers.JSONField()
    input = serializers.JSONField(
        source="pending_input",
        read_only=True,
        help_text="The data given with POST runs/{run_id}/input/ that the run has not taken "
        "yet (null when there is none): an external executor reads it here after it leases "
        "the run again; its next checkpoint takes it.",
    )

    class Meta:
        model = Run
        fields = [
            "run_id",
            "thread_id",
            "graph",
            "graph_version",
            "external",
            "status",
            "goal",
            "goal_rev",
            "checkpoint_rev",
            "next_step",
            "waiting_for",
            "input",
            "lease",
            "wake_at",
            "attention_reason",
            "last_error",
            "created_at",
            "updated_at",
        ]

    def get_lease(self, run: Run) -> dict[str, Any]:
        return {"owner": run.lease_owner, "expires_at": run.lease_expires_at, "fence": run.fence}


class CheckpointSerializer(serializers.ModelSerializer[Checkpoint]):
    state = serializers.JSONField()
    waits = serializers.JSONField()

    class Meta:
        model = Checkpoint
        fields = [
            "rev",
            "goal_rev",
            "step",
            "next_step",
            "status",
            "state",
            "waits",
            "digest",
            "created_at",
            "created_by",
            "fence",
        ]


class ActionSerializer(serializers.ModelSerializer[Action]):
    run_id = serializers.UUIDField(source="run.run_id", read_only=True)
    params = serializers.SerializerMethodField()
    result = serializers.JSONField()
    approval = serializers.SerializerMethodField()
    reconcile = serializers.SerializerMethodField(
        help_text="For an action nobody has proven (sent, unknown, manual_review): what "
        "happens next, by the tool's dedup contract — how: replay_same_key | lookup | "
        "manual_review (API.md, External executors); null otherwise."
    )

    class Meta:
        model = Action
        fields = [
            "action_id",
            "run_id",
            "idempotency_key",
            "tool",
            "tool_version",
            "params",
            "fingerprint",
            "status",
            "goal_rev",
            "external_id",
            "result",
            "approval",
            "attempts",
            "last_error",
            "sent_at",
            "in_flight_until",
            "reconcile",
            "created_at",
            "updated_at",
        ]

    def get_params(self, action: Action) -> Any:
        return json.loads(action.params)

    @extend_schema_field(
        {
            "type": "object",
            "nullable": True,
            "properties": {
                "how": {"type": "string", "enum": ["replay_same_key", "lookup", "manual_review"]},
                "not_found_after": {"type": "string", "format": "date-time", "nullable": True},
            },
            "required": ["how"],
        }
    )
    def get_reconcile(self, action: Action) -> dict[str, Any] | None:
        from runtime.protocol import reconcile_instruction

        return reconcile_instruction(action)

    def get_approval(self, action: Action) -> str | None:
        request = action.approvals.order_by("-created_at").first()
        return str(request.pk) if request is not None else None


# `Any`: it serialises a QuerySet of entries (many=True), which the stubs type only for
# ModelSerializer's instance.
class JournalEntrySerializer(serializers.Serializer[Any]):
    seq = serializers.IntegerField()
    type = serializers.CharField()
    actor = serializers.CharField()
    payload = serializers.JSONField()
    prev_hash = serializers.CharField()
    hash = serializers.CharField()
    created_at = serializers.DateTimeField()


class RunCreate(serializers.Serializer[Any]):
    graph = StrictChar(max_length=100)
    goal = JSONValue()
    thread_id = StrictChar(max_length=200, required=False)
    graph_version = StrictChar(max_length=40, required=False)
    external = StrictBool(
        default=False,
        help_text="The agent runs its own loop (executor protocol); "
        "Holdpoint's workers never pick the run up.",
    )


class RevisionIn(serializers.Serializer[Any]):
    goal = JSONValue()
    expected_goal_rev = StrictInt(min_value=1)


class InputIn(serializers.Serializer[Any]):
    # A declared field (API.md's name): DRF's metaclass moves it off the class, so the
    # serializer's `data` property stays what the base class says it is.
    data = JSONValue()  # type: ignore[assignment]
    expected_rev = StrictInt(min_value=0)


class CancelIn(serializers.Serializer[Any]):
    reason = StrictChar(max_length=NOTE_MAX, allow_blank=True, default="")


class ResumeIn(serializers.Serializer[Any]):
    expected_rev = StrictInt(min_value=0, required=False)


class LeaseIn(serializers.Serializer[Any]):
    owner = StrictChar(max_length=200)
    ttl_seconds = StrictInt(min_value=2, max_value=3600)


class FenceIn(serializers.Serializer[Any]):
    fence = StrictInt(min_value=1)


class ReleaseIn(FenceIn):
    owner = StrictChar(
        max_length=200,
        required=False,
        help_text="The owner the lease was taken by; when given, a lease held by another "
        "owner is refused (409 stale_fence) as a stale fence is.",
    )


class HeartbeatIn(ReleaseIn):
    ttl_seconds = StrictInt(
        min_value=2,
        max_value=3600,
        default=30,
        help_text="How long from now the lease lasts; send the ttl the lease was taken with.",
    )


class CheckpointIn(FenceIn):
    expected_rev = StrictInt(min_value=0)
    state = JSONValue()
    next_step = StrictChar(max_length=100, allow_blank=True)
    status = serializers.ChoiceField(
        choices=["running", "waiting_input", "completed", "failed"], default="running"
    )
    prompt = StrictChar(
        max_length=NOTE_MAX,
        allow_blank=True,
        default="",
        help_text="With status waiting_input: what the executor asks for. It becomes the "
        "run's waiting_for ({kind: input, prompt}), shown to whoever gives the input; with "
        "another status it is 422 invalid_params.",
    )


class ActionIn(FenceIn):
    tool = StrictChar(max_length=100)
    params = JSONValue()
    reason = StrictChar(max_length=5000, allow_blank=True, default="")
    target = StrictChar(max_length=300, allow_blank=True, default="")
    idempotency_key = StrictChar(max_length=255, required=False)
    expected_goal_rev = StrictInt(
        min_value=1,
        required=False,
        help_text="The goal revision the caller last read (and keyed the call under): "
        "409 version_conflict when the goal was revised since, and nothing is prepared.",
    )


class OutcomeIn(FenceIn):
    outcome = serializers.ChoiceField(
        choices=["confirmed", "failed", "unknown", "not_found"],
        help_text="not_found: a lookup by key (reconcile.how lookup) found nothing; "
        "accepted once the sender can no longer be in flight (reconcile.not_found_after).",
    )
    external_id = StrictChar(max_length=300, allow_blank=True, default="")
    result = serializers.JSONField(required=False, allow_null=True, default=None)


class ResolveIn(serializers.Serializer[Any]):
    outcome = serializers.ChoiceField(choices=["applied", "not_applied"])
    external_id = StrictChar(max_length=300, allow_blank=True, default="")
    note = StrictChar(max_length=NOTE_MAX, allow_blank=True, default="")


class LeaseOut(serializers.Serializer[dict[str, Any]]):
    fence = StrictInt()
    expires_at = serializers.DateTimeField()
    owner = serializers.CharField()


class HeartbeatOut(serializers.Serializer[dict[str, Any]]):
    fence = StrictInt()
    expires_at = serializers.DateTimeField()


class ReleaseOut(serializers.Serializer[dict[str, Any]]):
    fence = StrictInt()
    released = serializers.BooleanField()


class Problem(serializers.Serializer[dict[str, Any]]):
    """application/problem+json (RFC 9457) with a stable machine `code`."""

    type = serializers.CharField()
    title = serializers.CharField()
    status = serializers.IntegerField()
    detail = serializers.CharField()
    code = serializers.CharField()
    # A declared field, moved off the class like InputIn's `data`.
    errors = serializers.DictField(  # type: ignore[assignment]
        child=serializers.ListField(child=serializers.CharField()), required=False
    )
