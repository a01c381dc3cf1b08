"""`tools/`: the tools a tenant may use, and defining them (API.md, "Tools as data").

Anyone of the tenant lists and reads them (an agent must know what it may call); only a
tenant admin defines one (`POST tools/`) or makes a new version (`PUT tools/{name}/` with
`expected_version`). Validation, versions and storage are `runtime.tooldefs`'; what is
listed is `runtime.toolcatalog`'s. Refusals store nothing.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from drf_spectacular.utils import (
    OpenApiExample,
    OpenApiParameter,
    extend_schema,
    extend_schema_field,
    inline_serializer,
)
from rest_framework import serializers
from rest_framework import status as http
from rest_framework.request import Request
from rest_framework.response import Response

from runtime import toolcatalog
from runtime.api.base import ApiView
from runtime.api.idempotency import idempotent, settler
from runtime.errors import InvalidParams, NotFound, NotPermitted
from runtime.models import Role, ToolDefinition
from runtime.models.tooldefs import MAX_TIMEOUT, MIN_TIMEOUT
from runtime.tenancy import Principal
from runtime.tooldefs import EFFECTS, EXECUTORS, METHODS, MODES

PAGE_SIZE = 100


@extend_schema_field({"type": "object", "additionalProperties": True})
class JSONObject(serializers.JSONField):
    """A JSON object (a JSON Schema, here)."""


class RequestSpec(serializers.Serializer[dict[str, Any]]):
    method = serializers.ChoiceField(choices=METHODS)
    url = serializers.CharField(help_text="URL template: {param} in the path or query only.")
    headers = serializers.DictField(child=serializers.CharField(), required=False)


class DedupSpec(serializers.Serializer[dict[str, Any]]):
    mode = serializers.ChoiceField(choices=MODES)
    header = serializers.CharField(required=False, help_text="default Idempotency-Key")


class LookupSpec(serializers.Serializer[dict[str, Any]]):
    method = serializers.ChoiceField(choices=("GET", "POST"), required=False)
    url = serializers.CharField(required=False, help_text="may cite {idempotency_key}")
    found = serializers.CharField(
        help_text="JSONPath (RFC 9535) of the found id. Absent (the action may be sent again) "
        "only on a 404, where the path stops at an empty list or object or null, or where its "
        "own filter chose none of the records; an answer "
        "with a record the path does not reach into is no answer (asked again, then a person)"
    )


class ResultSpec(serializers.Serializer[dict[str, Any]]):
    external_id = serializers.CharField(help_text="JSONPath (RFC 9535), default $.id")


class DefinitionFields(serializers.Serializer[dict[str, Any]]):
    """The fields of a definition (API.md's example), shared by what is sent and shown."""

    name = serializers.CharField(max_length=100, help_text="e.g. tickets.create")
    title = serializers.CharField(
        required=False, allow_blank=True, help_text='reviewer\'s card, e.g. "Open ticket: {title}"'
    )
    description = serializers.CharField(required=False, allow_blank=True)
    effect = serializers.ChoiceField(choices=EFFECTS)
    schema = JSONObject(required=False, help_text="JSON Schema (2020-12) of the params object")
    editable = serializers.ListField(child=serializers.CharField(), required=False)
    sensitive = serializers.ListField(child=serializers.CharField(), required=False)
    executor = serializers.ChoiceField(choices=EXECUTORS, required=False)
    request = RequestSpec(required=False, help_text="http tools only")
    credential = serializers.CharField(required=False, allow_blank=True)
    dedup = DedupSpec()
    lookup = LookupSpec(required=False)
    result = ResultSpec(required=False)
    timeout_seconds = serializers.FloatField(
        required=False, min_value=MIN_TIMEOUT, max_value=MAX_TIMEOUT, help_text="default 5"
    )
    compensation = serializers.CharField(required=False, allow_blank=True)
    compensation_param = serializers.CharField(required=False, allow_blank=True)


class ToolIn(DefinitionFields):
    """`POST tools/`: a definition. Documentation only: `runtime.tooldefs.parse` validates
    it, so every refusal is 422 `invalid_tool` with all field errors at once."""


class ToolRevisionIn(DefinitionFields):
    """`PUT tools/{name}/`: the whole new definition and the version it replaces."""

    name = serializers.CharField(max_length=100, required=False, help_text="the URL's name")
    expected_version = serializers.IntegerField(min_value=1)


class ToolSerializer(serializers.Serializer[Any]):  # a toolcatalog.Entry
    name = serializers.CharField()
    version = serializers.IntegerField()
    builtin = serializers.BooleanField()
    title = serializers.CharField()
    description = serializers.CharField()
    effect = serializers.ChoiceField(choices=EFFECTS)
    executor = serializers.ChoiceField(choices=EXECUTORS)
    schema = JSONObject()
    editable = serializers.ListField(child=serializers.CharField())
    sensitive = serializers.ListField(child=serializers.CharField())
    request = RequestSpec(allow_null=True, help_text="null for client tools")
    credential = serializers.CharField()
    dedup = DedupSpec()
    lookup = LookupSpec(allow_null=True)
    result = ResultSpec()
    timeout_seconds = serializers.FloatField()
    compensation = serializers.CharField()
    compensation_param = serializers.CharField()
    approval_by_default = serializers.BooleanField(
        help_text="true: a tenant tool that changes something and that no active policy "
        "names; its actions wait for a reviewer until a policy says otherwise"
    )
    digest = serializers.CharField(help_text="SHA-256 of the canonical definition")
    created_at = serializers.DateTimeField(allow_null=True, help_text="null for built-ins")
    created_by = serializers.CharField()

    def to_representation(self, instance: Any) -> dict[str, Any]:
        data = instance.as_dict() if isinstance(instance, toolcatalog.Entry) else dict(instance)
        data.setdefault("request", None)
        data.setdefault("lookup", None)
        for text in ("title", "description", "credential", "compensation", "created_by"):
            data[text] = data.get(text) or ""
        data.setdefault("compensation_param", "external_id")
        return super().to_representation(data)


TOOL_PAGE = inline_serializer(
    name="ToolPage",
    fields={
        "next": serializers.URLField(allow_null=True),
        "previous": serializers.URLField(allow_null=True),
        "results": ToolSerializer(many=True),
    },
)
EXAMPLE = OpenApiExample(
    "An http tool with an idempotency key",
    request_only=True,
    value={
        "name": "tickets.create",
        "description": "Open a ticket",
        "effect": "write",
        "schema": {
            "type": "object",
            "properties": {"title": {"type": "string"}},
            "required": ["title"],
        },
        "editable": ["title"],
        "executor": "http",
        "request": {"method": "POST", "url": "http://127.0.0.1:8765/tasks", "headers": {}},
        "credential": "tasks",
        "dedup": {"mode": "key", "header": "Idempotency-Key"},
        "lookup": {"url": "http://127.0.0.1:8765/tasks?key={idempotency_key}", "found": "$[0].id"},
        "result": {"external_id": "$.id"},
        "timeout_seconds": 5,
    },
)


def _cursor(direction: str, name: str) -> str:
    return base64.urlsafe_b64encode(f"{direction}:{name}".encode()).decode().rstrip("=")


def _position(raw: str | None) -> tuple[str, str]:
    """A cursor is the last (or first) name seen: `a:` after it, `b:` before it."""
    if not raw:
        return "a", ""
    try:
        text = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        text = ""
    direction, _, name = text.partition(":")
    if direction not in ("a", "b") or not name:
        raise InvalidParams("invalid cursor", errors={"cursor": ["invalid cursor"]})
    return direction, name


class ToolAdminOnly:
    @staticmethod
    def admin(principal: Principal) -> Principal:
        """Defining a tool decides what agents can do and where requests go: the tenant's
        admins only (an agent cannot widen its own powers, a reviewer not the tools)."""
        if principal.role != Role.ADMIN:
            raise NotPermitted("only an admin of the tenant defines tools")
        return principal


class ToolList(ApiView, ToolAdminOnly):
    @extend_schema(
        operation_id="tools_list",
        responses=TOOL_PAGE,
        parameters=[OpenApiParameter("cursor", str, description="from next or previous")],
    )
    def get(self, request: Request) -> Response:
        principal = self.principal(request)
        direction, name = _position(request.query_params.get("cursor"))
        every = toolcatalog.offered(principal.tenant.pk)
        if direction == "a":
            rest = [e for e in every if e.name > name]
            page, more_after, more_before = rest[:PAGE_SIZE], len(rest) > PAGE_SIZE, bool(name)
        else:
            rest = [e for e in every if e.name < name]
            page, more_after, more_before = rest[-PAGE_SIZE:], True, len(rest) > PAGE_SIZE
        base = request.build_absolute_uri(request.path)
        return Response(
            {
                "next": f"{base}?cursor={_cursor('a', page[-1].name)}"
                if page and more_after
                else None,
                "previous": f"{base}?cursor={_cursor('b', page[0].name)}"
                if page and more_before
                else None,
                "results": ToolSerializer(page, many=True).data,
            }
        )

    @extend_schema(request=ToolIn, examples=[EXAMPLE], responses={201: ToolSerializer})
    @idempotent
    def post(self, request: Request) -> Response:
        principal = self.admin(self.principal(request))
        row = toolcatalog.create(
            principal.tenant, request.data, self.actor(request), settle=settler(request)
        )
        return self.effect_response(request, row.pk, True)

    def effect_response(self, request: Request, effect: Any, created: bool) -> Response:
        """The answer for the tool definition `effect` (a row's pk): made or found again."""
        tenant = self.principal(request).tenant
        row = ToolDefinition.objects.get(pk=effect, tenant=tenant)
        entry = toolcatalog.entry(tenant.pk, row.name, row.version)
        return Response(ToolSerializer(entry).data, status=http.HTTP_201_CREATED)


def _version(request: Request) -> int | None:
    raw = request.query_params.get("version")
    if raw is None:
        return None
    if not raw.isascii() or not raw.isdigit() or int(raw) < 1:
        raise InvalidParams(
            "version must be a positive integer", errors={"version": ["an integer from 1"]}
        )
    return int(raw)


class ToolDetail(ApiView, ToolAdminOnly):
    @extend_schema(
        responses=ToolSerializer,
        parameters=[
            OpenApiParameter("version", int, description="an older version (default: current)")
        ],
    )
    def get(self, request: Request, name: str) -> Response:
        principal = self.principal(request)
        entry = toolcatalog.offered_entry(principal.tenant.pk, name, _version(request))
        if entry is None:
            raise NotFound()
        return Response(ToolSerializer(entry).data)

    @extend_schema(
        request=ToolRevisionIn,
        responses={200: ToolSerializer},
        description="A new version of a tenant's tool (an unchanged definition stays the "
        "current version). 409 version_conflict when `expected_version` is not the current.",
    )
    def put(self, request: Request, name: str) -> Response:
        principal = self.principal(request)
        if toolcatalog.entry(principal.tenant.pk, name) is None:
            raise NotFound()  # scoped first, like every object: 404, then 403
        self.admin(principal)
        row = toolcatalog.revise(principal.tenant, name, request.data, self.actor(request))
        entry = toolcatalog.entry(principal.tenant.pk, row.name, row.version)
        return Response(ToolSerializer(entry).data)
