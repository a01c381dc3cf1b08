"""Tool definitions in Django admin (API.md, "Tools as data"), tenant-scoped like the rest.

The list shows the current version of each of the admin's tenants' tools, and says next to
each one that changes something and that no policy names that its actions wait for a
reviewer. Adding or "changing" a tool never edits a row: the JSON typed into the form is
validated (every field error shown on the form) and stored by `tooldefs.define` as the next
version; the change page lists the versions, and an older one can be opened, read and saved
again as the newest. "Test this tool" validates params against the schema and shows the
request Holdpoint would send — credential masked — without sending anything.
"""

from __future__ import annotations

import json
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.db.models import Exists, OuterRef, QuerySet
from django.http import Http404, HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from audit.canonical import parse_strict
from runtime import gates, toolcatalog, tooldefs
from runtime.admin import TenantScopedAdmin, _actor, admin_tenants
from runtime.errors import HoldpointError, InvalidParams
from runtime.models import McpServer, Tenant, ToolDefinition
from runtime.models.mcp import ADDRESS

ORDER = list(tooldefs.FIELDS)  # the order an admin reads a definition in
NEEDS_APPROVAL = "needs approval by default (no policy names it)"
TEMPLATE = {
    "name": "tickets.create",
    "title": "Open ticket: {title}",
    "effect": "write",
    "schema": {
        "type": "object",
        "properties": {"title": {"type": "string", "minLength": 1}},
        "required": ["title"],
        "additionalProperties": False,
    },
    "editable": ["title"],
    "executor": "http",
    "request": {"method": "POST", "url": "http://127.0.0.1:8765/tasks", "headers": {}},
    "credential": "tasks",
    "dedup": {"mode": "key", "header": "Idempotency-Key"},
    "result": {"external_id": "$.id"},
    "timeout_seconds": 5,
}


def pretty(spec: dict[str, Any]) -> str:
    ordered = {key: spec[key] for key in ORDER if key in spec}
    ordered.update({key: value for key, value in spec.items() if key not in ordered})
    return json.dumps(ordered, indent=2, ensure_ascii=False)


def _add_errors(form: forms.BaseForm, field: str, exc: Exception) -> None:
    errors = getattr(exc, "extra", {}).get("errors") or {}
    for where, found in errors.items():
        for message in found:
            form.add_error(field, f"{where}: {message}")
    if not errors:
        form.add_error(field, str(exc))


class ToolDefinitionForm(forms.ModelForm[ToolDefinition]):
    """The definition as JSON in a textarea; `clean` runs the same validation as the API and
    the import, so a refused definition is redisplayed with its errors and nothing stored."""

    tenant = forms.ModelChoiceField(queryset=Tenant.objects.none())
    definition = forms.CharField(
        widget=forms.Textarea(
            attrs={"rows": 32, "cols": 100, "spellcheck": "false", "class": "vLargeTextField"}
        ),
        help_text="The tool as JSON (API.md, Tools as data). Saving stores it as a new "
        "version; an unchanged definition stays the current version.",
    )

    class Meta:
        model = ToolDefinition
        fields: list[str] = []

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data
        tenant = data.get("tenant") or (self.instance.tenant if self.instance.pk else None)
        text = data.get("definition")
        if tenant is None or text is None:
            return data
        try:
            spec = parse_strict(text)  # as the API parses it: no duplicate keys, NaN, depth
        except ValueError as exc:
            self.add_error("definition", f"not JSON: {exc}")
            return data
        name = spec.get("name") if isinstance(spec, dict) else None
        if self.instance.pk and name != self.instance.name:
            self.add_error(
                "definition", f"name: this is {self.instance.name}; add a tool for another name"
            )
            return data
        try:
            tooldefs.parse(spec, known_tools=toolcatalog.known_names(tenant), tenant_id=tenant.pk)
        except (tooldefs.InvalidTool, tooldefs.HostNotAllowed) as exc:
            _add_errors(self, "definition", exc)
            return data
        data["tenant"], data["spec"] = tenant, spec
        if not self.instance.pk:
            self.instance.tenant = tenant  # the model's own checks see the chosen tenant
        return data


class CurrentVersions(ChangeList):
    """The list shows each tool once, at its current (highest) version."""

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        newer = ToolDefinition.objects.filter(
            tenant=OuterRef("tenant"), name=OuterRef("name"), version__gt=OuterRef("version")
        )
        return super().get_queryset(request, exclude_parameters).filter(~Exists(newer))


class DryRunForm(forms.Form):
    params = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 10, "cols": 80, "spellcheck": "false"}),
        initial="{}",
        help_text="The params of one call, as JSON. Nothing is sent.",
    )

    def clean_params(self) -> Any:
        try:
            return parse_strict(self.cleaned_data["params"])
        except ValueError as exc:
            raise forms.ValidationError(f"not JSON: {exc}") from None


@admin.register(ToolDefinition)
class ToolDefinitionAdmin(TenantScopedAdmin):
    form = ToolDefinitionForm
    list_display = [
        "name",
        "tenant",
        "version",
        "effect",
        "executor",
        "dedup_mode",
        "approval_note",
        "created_at",
        "created_by",
    ]
    # No tenant filter: its choices would list every tenant's name to a tenant admin.
    search_fields = ["name"]
    ordering = ["tenant__slug", "name"]

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return CurrentVersions

    def get_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        if obj is None:
            return ("tenant", "definition")
        return (
            "tenant",
            "version_line",
            "approval_note",
            "test_link",
            "definition",
            "history",
        )

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        return () if obj is None else ("version_line", "approval_note", "test_link", "history")

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> type[forms.ModelForm[Any]]:
        kwargs["fields"] = []
        form = super().get_form(request, obj, change=change, **kwargs)
        # New field objects per request (the form class is shared between requests): the
        # tenant choices are the admin's own, the definition starts as the one shown.
        definition = forms.CharField(
            widget=ToolDefinitionForm.base_fields["definition"].widget,
            help_text=ToolDefinitionForm.base_fields["definition"].help_text,
            initial=pretty(obj.spec) if obj is not None else pretty(TEMPLATE),
        )
        tenants = admin_tenants(request)
        form.base_fields = {
            "tenant": forms.ModelChoiceField(
                queryset=tenants,
                disabled=obj is not None,
                initial=obj.tenant_id if obj is not None else None,
                required=obj is None,
            ),
            "definition": definition,
        }
        return form

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # versions are kept: actions and approvals cite them

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        """The one writer stores the definition as the next version; the admin goes on
        (history entry, redirect) with the row it stored, never saving `obj` itself."""
        defined = tooldefs.define(
            form.cleaned_data["tenant"],
            form.cleaned_data["spec"],
            _actor(request),
            known_tools=toolcatalog.known_names(form.cleaned_data["tenant"]),
        )
        row = defined.definition
        for field in ToolDefinition._meta.concrete_fields:
            setattr(obj, field.attname, getattr(row, field.attname))
        obj._state.adding = False
        if defined.created:
            self.message_user(request, f"{row.name}: stored as version {row.version}.")
        else:
            self.message_user(
                request,
                f"{row.name}: unchanged, version {row.version} stays current.",
                messages.WARNING,
            )

    # --- columns -------------------------------------------------------------------------

    @admin.display(description="dedup")
    def dedup_mode(self, obj: ToolDefinition) -> str:
        return str((obj.spec.get("dedup") or {}).get("mode", ""))

    @admin.display(description="effect")
    def effect(self, obj: ToolDefinition) -> str:
        return str(obj.spec.get("effect", ""))

    @admin.display(description="executor")
    def executor(self, obj: ToolDefinition) -> str:
        return str(obj.spec.get("executor", ""))

    @admin.display(description="approval")
    def approval_note(self, obj: ToolDefinition) -> str:
        named = gates.tools_named_by_policy(obj.tenant_id)  # one small query per row shown
        if toolcatalog.needs_approval_by_default(obj.spec, named):
            return NEEDS_APPROVAL
        return "a policy decides" if obj.name in named else "not needed (read only)"

    @admin.display(description="version")
    def version_line(self, obj: ToolDefinition) -> str:
        current = tooldefs.current(obj.tenant_id, obj.name)
        latest = current.version if current is not None else obj.version
        state = "current" if obj.version == latest else f"an older version (current: {latest})"
        return f"{obj.name} version {obj.version}, {state}; by {obj.created_by or '?'}"

    @admin.display(description="versions")
    def history(self, obj: ToolDefinition) -> SafeString:
        rows = toolcatalog.versions(obj.tenant_id, obj.name)
        return format_html(
            "<ul>{}</ul>",
            format_html_join(
                "",
                '<li><a href="{}">version {}</a> — {} by {} ({})</li>',
                (
                    (
                        reverse("admin:runtime_tooldefinition_change", args=[row.pk]),
                        row.version,
                        row.created_at.strftime("%Y-%m-%d %H:%M:%S UTC"),
                        row.created_by or "?",
                        row.digest[:12],
                    )
                    for row in rows
                ),
            ),
        )

    @admin.display(description="test")
    def test_link(self, obj: ToolDefinition) -> SafeString:
        url = reverse("admin:runtime_tooldefinition_test", args=[obj.pk])
        return format_html('<a href="{}">Test this tool</a> (a dry run: nothing is sent)', url)

    # --- the dry run ---------------------------------------------------------------------

    def get_urls(self) -> list[URLPattern]:
        test = path(
            "<path:object_id>/test/",
            self.admin_site.admin_view(self.test_view),
            name="runtime_tooldefinition_test",
        )
        return [test, *super().get_urls()]

    def test_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Validate params and show the request they would make. Reading only: the view
        permission is enough, and another tenant's definition is not found."""
        obj = self.get_object(request, object_id)
        if obj is None or not self.has_view_permission(request, obj):
            raise Http404("no such tool definition")
        form = DryRunForm(request.POST or None)
        result = None
        if request.method == "POST" and form.is_valid():
            try:
                result = toolcatalog.dry_run(
                    obj.tenant_id, obj.name, form.cleaned_data["params"], version=obj.version
                )
            except InvalidParams as exc:
                _add_errors(form, "params", exc)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.model._meta,
            "original": obj,
            "title": f"Test {obj.name} (version {obj.version})",
            "form": form,
            "result": result,
            "headers": sorted((result.headers or {}).items()) if result else [],
        }
        return TemplateResponse(request, "admin/runtime/tooldefinition/test.html", context)


# --- upstream MCP servers ----------------------------------------------------------------


@admin.register(McpServer)
class McpServerAdmin(TenantScopedAdmin):
    """A tenant's upstream MCP servers (issue 19). "Import tools" asks the server for its
    tools and stores each as a definition through `tooldefs.define` (an unchanged tool
    keeps its version); its `executor: mcp` tools are then held, sent and reconciled like
    any other."""

    list_display = ["name", "tenant", "transport", "url", "command", "active", "updated_at"]
    search_fields = ["name"]
    fields = [
        "tenant",
        "name",
        "transport",
        "url",
        "command",
        "args",
        "credential",
        "timeout_seconds",
        "active",
    ]
    actions = ["import_tools"]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        """Where a registered server is reached cannot change (`McpServer.clean`)."""
        fixed = ADDRESS if obj is not None else ()
        return (*super().get_readonly_fields(request, obj), *fixed)

    def has_import_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("runtime.add_tooldefinition"))

    @admin.action(description="Import tools (stores new versions of changed tools)")
    def import_tools(self, request: HttpRequest, queryset: QuerySet[McpServer]) -> None:
        from runtime import mcpimport

        for server in queryset.select_related("tenant"):
            try:
                imported = mcpimport.import_tools(server, _actor(request))
            except HoldpointError as exc:
                errors = exc.extra.get("errors") or {}
                lines = "".join(f"; {k}: {', '.join(v)}" for k, v in errors.items())
                self.message_user(
                    request,
                    f"{server.name}: nothing imported ({exc.detail}{lines})",
                    messages.ERROR,
                )
                continue
            created = sum(1 for item in imported.tools if item.created)
            self.message_user(
                request,
                f"{server.name}: {len(imported.tools)} tool(s), {created} new version(s), "
                f"{len(imported.tools) - created} unchanged.",
            )
            if imported.unlisted:
                self.message_user(
                    request,
                    f"{server.name}: {len(imported.unlisted)} tool(s) no longer listed by "
                    "the server, kept as defined and still offered to agents (the server "
                    f"refuses a tool it does not have): {', '.join(imported.unlisted)}.",
                    messages.WARNING,
                )

    import_tools.allowed_permissions = ("import",)  # type: ignore[attr-defined]
