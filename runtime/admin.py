"""Django admin for operators and tenant admins.

Superusers (operators) see every tenant. A tenant admin — staff, not superuser, with an
`admin` membership — sees and edits only their own tenants' memberships, agent accounts
and tokens: every queryset and every foreign-key choice is narrowed by `admin_tenants()`,
so another tenant's object is absent (404 on its URL), not merely read-only. The journal's
admin is here too: it is scoped by the same tenants.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.contrib.auth import get_user_model
from django.core.paginator import Paginator
from django.db import transaction
from django.db.models import ForeignKey, Q, QuerySet
from django.db.models.expressions import Combinable
from django.forms import ModelChoiceField
from django.http import HttpRequest
from django.utils.functional import cached_property

from audit.models import JournalEntry
from runtime import outbound
from runtime.accounts import record_tenant_act
from runtime.auth import DEFAULT_OVERLAP, Issued, issue_token, revoke_token, rotate_tokens
from runtime.crypto import SecretUnreadable
from runtime.errors import HoldpointError, InvalidTransition
from runtime.lifecycle import cancel_run, has_something_to_resume, resume_run
from runtime.models import (
    TERMINAL,
    AgentAccount,
    AgentToken,
    Membership,
    Role,
    Run,
    Tenant,
    ToolCredential,
)
from runtime.pages.audit import KNOWN_TYPES

User = get_user_model()


def admin_tenants(request: HttpRequest) -> QuerySet[Tenant]:
    user = request.user
    if user.is_superuser:
        return Tenant.objects.all()
    if not user.is_authenticated:  # the admin lets only staff in: no tenant for anyone else
        return Tenant.objects.none()
    return Tenant.objects.filter(memberships__user=user, memberships__role=Role.ADMIN, active=True)


def admin_users(request: HttpRequest) -> QuerySet[Any]:
    """Users a tenant admin may see: members of the tenants they administer."""
    if request.user.is_superuser:
        return User.objects.all()
    return User.objects.filter(memberships__tenant__in=admin_tenants(request)).distinct()


class AuditedAdmin(admin.ModelAdmin[Any]):
    """Every change made in the admin is written to the tenant's stream, in the same
    transaction (Django's admin wraps each save and delete in one)."""

    def tenant_of(self, obj: Any) -> int | None:
        return getattr(obj, "tenant_id", None)

    def _record(self, request: HttpRequest, obj: Any, type: str, **payload: Any) -> None:
        tenant_id = self.tenant_of(obj)
        if tenant_id is not None:
            record_tenant_act(
                tenant_id,
                type,
                f"user:{request.user.get_username()}",
                model=obj._meta.label,
                object=str(obj.pk),
                repr=str(obj)[:200],
                **payload,
            )

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        super().save_model(request, obj, form, change)
        self._record(
            request,
            obj,
            "admin_changed" if change else "admin_added",
            fields=sorted(form.changed_data),
        )

    def delete_model(self, request: HttpRequest, obj: Any) -> None:
        tenant_id = self.tenant_of(obj)
        super().delete_model(request, obj)
        if tenant_id is not None:
            record_tenant_act(
                tenant_id,
                "admin_deleted",
                f"user:{request.user.get_username()}",
                model=obj._meta.label,
                repr=str(obj)[:200],
            )

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        for obj in queryset:
            self.delete_model(request, obj)


class ReadOnlyAdmin(admin.ModelAdmin[Any]):
    """Records nobody edits in the admin (the journal, decided requests, deliveries): every
    field shown, nothing added, changed or deleted — their writers are the domain's own."""

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [field.name for field in self.model._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class OperationsAdmin(admin.ModelAdmin[Any]):
    """Admin actions that call a domain writer on each selected row ("operations": resume a
    run, reassign a request, redeliver a webhook). The rows come from `get_queryset`, so a
    tenant admin's selection is narrowed to their tenants — another tenant's id in the POST
    selects nothing. The writer journals; the action only reports what it did."""

    def has_operate_permission(self, request: HttpRequest) -> bool:
        """Operating needs the model's change permission (tenant admins hold it, through
        the tenant-admins group), although no field of these rows is ever edited."""
        opts = self.model._meta
        return request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}")

    def operate(
        self,
        request: HttpRequest,
        queryset: QuerySet[Any],
        verb: str,
        writer: Any,
    ) -> None:
        """`writer(obj, actor)` on each row; a refusal (HoldpointError) is reported for its
        row and the others go on."""
        done, refused = 0, []
        for obj in queryset:
            try:
                writer(obj, _actor(request))
            except HoldpointError as exc:
                refused.append(f"{obj}: {exc}")
            else:
                done += 1
        if done:
            self.message_user(request, f"{verb}: {done}.", messages.SUCCESS)
        for line in refused:
            self.message_user(request, f"Not {verb.lower()}: {line}", messages.ERROR)


class TenantScopedAdmin(AuditedAdmin):
    """Narrows the changelist, the change form and every FK choice to the admin's tenants."""

    tenant_path = "tenant"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        qs = super().get_queryset(request)
        if request.user.is_superuser:
            return qs
        return qs.filter(**{f"{self.tenant_path}__in": admin_tenants(request)}).distinct()

    def formfield_for_foreignkey(
        self, db_field: ForeignKey[Any, Any], request: HttpRequest, **kwargs: Any
    ) -> ModelChoiceField[Any] | None:
        if db_field.related_model is Tenant:
            kwargs["queryset"] = admin_tenants(request)
        elif db_field.related_model is User:
            kwargs["queryset"] = admin_users(request)
        return super().formfield_for_foreignkey(db_field, request, **kwargs)


@admin.register(Tenant)
class TenantAdmin(AuditedAdmin):
    list_display = ["slug", "name", "active", "retention_days", "created_at"]
    search_fields = ["slug", "name"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Tenant]:
        return admin_tenants(request)

    def tenant_of(self, obj: Tenant) -> int | None:
        return obj.pk

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        # Only operators create, rename the slug of, or deactivate tenants.
        return [] if request.user.is_superuser else ["slug", "active"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return request.user.is_superuser

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return request.user.is_superuser


class MembershipForm(forms.ModelForm[Membership]):
    class Meta:
        model = Membership
        fields = ["tenant", "user", "role"]

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data
        if self.instance and data.get("user") and data.get("role"):
            self.instance.user = data["user"]
            self.instance.role = data["role"]
        return data


@admin.register(Membership)
class MembershipAdmin(TenantScopedAdmin):
    form = MembershipForm
    list_display = ["user", "tenant", "role", "created_at"]
    list_filter = ["role"]
    search_fields = ["user__username"]


class AgentAccountForm(forms.ModelForm[AgentAccount]):
    tenant = forms.ModelChoiceField(queryset=Tenant.objects.none())

    class Meta:
        model = AgentAccount
        fields = ["username", "is_active"]


@admin.register(AgentAccount)
class AgentAccountAdmin(AuditedAdmin):
    form = AgentAccountForm
    list_display = ["username", "is_active", "tenant_slug"]
    search_fields = ["username"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return AgentAccount.objects.filter(
            memberships__role=Role.AGENT, memberships__tenant__in=admin_tenants(request)
        ).distinct()

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> type[forms.ModelForm[Any]]:
        form = super().get_form(request, obj, change=change, **kwargs)
        # A new field object per request: the form class's fields are shared between
        # requests (threads), so narrowing them in place could leak one tenant's choices.
        form.base_fields = {
            **form.base_fields,
            "tenant": forms.ModelChoiceField(
                queryset=admin_tenants(request), required=obj is None, disabled=obj is not None
            ),
        }
        return form

    @admin.display(description="tenant")
    def tenant_slug(self, obj: Any) -> str:
        membership = obj.memberships.first()
        return membership.tenant.slug if membership else ""

    @transaction.atomic
    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        if not change:
            # Agents authenticate with tokens only; an unusable password closes the
            # session-login door.
            obj.set_unusable_password()
        admin.ModelAdmin.save_model(self, request, obj, form, change)
        if not change:
            Membership.objects.create(tenant=form.cleaned_data["tenant"], user=obj, role=Role.AGENT)
        # Recorded once the membership exists: it names the tenant whose stream gets it.
        self._record(
            request,
            obj,
            "admin_changed" if change else "admin_added",
            fields=sorted(form.changed_data),
        )

    def tenant_of(self, obj: Any) -> int | None:
        return Membership.objects.filter(user=obj).values_list("tenant_id", flat=True).first()


def _actor(request: HttpRequest) -> str:
    return f"user:{request.user.get_username()}"


def _agents_of(request: HttpRequest) -> QuerySet[Any]:
    """Agent accounts a token may be issued to from the admin: those of the admin's tenants
    (people get none: API tokens are for agent accounts only)."""
    return User.objects.filter(
        memberships__tenant__in=admin_tenants(request), memberships__role=Role.AGENT
    ).distinct()


def _show_key(request: HttpRequest, issued: Issued) -> None:
    messages.warning(
        request,
        f"New token for {issued.token.user.get_username()} — copy it now, it is shown only "
        f"this once and cannot be recovered: {issued.key}",
    )


@admin.register(AgentToken)
class AgentTokenAdmin(TenantScopedAdmin):
    """Agent tokens of the admin's tenants. Adding one issues a token and shows its key once
    (a message); a token is never edited or deleted, only revoked or rotated (actions), and
    nothing but its prefix is ever shown."""

    list_display = [
        "prefix",
        "user",
        "tenant",
        "name",
        "status_display",
        "created_at",
        "expires_at",
        "last_used_at",
        "created_by",
    ]
    search_fields = ["prefix", "name", "user__username"]
    actions = ["revoke_selected", "rotate_selected"]
    add_fields = ("user", "name", "expires_at")
    shown_fields = (
        "prefix",
        "user",
        "tenant",
        "name",
        "status_display",
        "created_at",
        "created_by",
        "expires_at",
        "revoked_at",
        "last_used_at",
    )

    def get_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        return self.add_fields if obj is None else self.shown_fields

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        return () if obj is None else self.shown_fields

    def formfield_for_foreignkey(
        self, db_field: ForeignKey[Any, Any], request: HttpRequest, **kwargs: Any
    ) -> ModelChoiceField[Any] | None:
        field = super().formfield_for_foreignkey(db_field, request, **kwargs)
        # After the tenant scoping above, which would offer every member: people get no token.
        if db_field.name == "user" and field is not None:
            field.queryset = _agents_of(request)
        return field

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # revoke instead: the row stays, and so does what it did

    @admin.display(description="status")
    def status_display(self, obj: AgentToken) -> str:
        return obj.status()

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        if change:
            return  # every field is read-only once issued
        issued = issue_token(
            form.cleaned_data["user"],
            actor=_actor(request),
            name=obj.name,
            expires_at=obj.expires_at,
        )
        # The admin goes on with `obj` (history entry, redirect): make it the issued row.
        for field in AgentToken._meta.concrete_fields:
            setattr(obj, field.attname, getattr(issued.token, field.attname))
        obj._state.adding = False
        _show_key(request, issued)

    @admin.action(description="Revoke selected tokens (refused from the next request)")
    def revoke_selected(self, request: HttpRequest, queryset: QuerySet[AgentToken]) -> None:
        revoked = sum(revoke_token(token, actor=_actor(request)) for token in queryset)
        self.message_user(request, f"Revoked {revoked} token(s).", messages.SUCCESS)

    revoke_selected.allowed_permissions = ("change",)  # type: ignore[attr-defined]

    @admin.action(description="Rotate selected tokens (old ones keep working for 24 hours)")
    def rotate_selected(self, request: HttpRequest, queryset: QuerySet[AgentToken]) -> None:
        owners: dict[tuple[int, int], list[AgentToken]] = {}
        for token in queryset.select_related("user", "tenant"):
            if token.is_live():
                owners.setdefault((token.user_id, token.tenant_id), []).append(token)
        for tokens in owners.values():
            issued, _ = rotate_tokens(
                tokens[0].user,
                actor=_actor(request),
                tenant=tokens[0].tenant,
                replace=tokens,
                overlap=DEFAULT_OVERLAP,
            )
            _show_key(request, issued)
        if not owners:
            self.message_user(request, "No live token selected.", messages.WARNING)

    rotate_selected.allowed_permissions = ("change",)  # type: ignore[attr-defined]


class ToolCredentialForm(forms.ModelForm[ToolCredential]):
    """The secret is write-only: typed into a password field that never renders a value;
    empty on a change keeps the stored one."""

    service = forms.RegexField(
        regex=r"^[a-z0-9][a-z0-9_.-]{0,63}$",
        max_length=64,
        help_text="The name tool definitions give as their `credential` (e.g. tasks).",
    )
    secret = forms.CharField(
        label="new secret",
        required=False,
        strip=False,
        widget=forms.PasswordInput(render_value=False, attrs={"autocomplete": "new-password"}),
        help_text="Write-only: it is stored encrypted and never shown again. "
        "Leave empty to keep the current one.",
    )

    class Meta:
        model = ToolCredential
        fields = ["tenant", "service"]

    def clean_secret(self) -> str:
        value: str = self.cleaned_data.get("secret", "")
        if not value and self.instance.pk is None:
            raise forms.ValidationError("A new credential needs its secret.")
        try:  # it is sent as a bearer token: a value no header can carry is never sent
            outbound.check_headers({"Authorization": f"Bearer {value}"})
        except outbound.OutboundRefused:
            raise forms.ValidationError(
                "A credential is sent in an HTTP header: no line breaks, control characters"
                " or characters outside Latin-1."
            ) from None
        return value


@admin.register(ToolCredential)
class ToolCredentialAdmin(TenantScopedAdmin):
    form = ToolCredentialForm
    list_display = ["service", "tenant", "secret_state", "updated_at", "updated_by"]
    search_fields = ["service"]

    def get_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        if obj is None:
            return ("tenant", "service", "secret")
        return ("tenant", "service", "secret_state", "secret", "updated_at", "updated_by")

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        # The ciphertext is bound to its tenant and service: they never change.
        return (
            () if obj is None else ("tenant", "service", "secret_state", "updated_at", "updated_by")
        )

    @admin.display(description="secret")
    def secret_state(self, obj: ToolCredential) -> str:
        if not obj.is_set:
            return "not set"
        try:
            obj.secret()
        except SecretUnreadable:
            return "set (unreadable with the configured keys)"
        return "set"

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        if form.cleaned_data.get("secret"):
            obj.set_secret(form.cleaned_data["secret"], actor=_actor(request))
        super().save_model(request, obj, form, change)


# --- runs: inspected, resumed, cancelled -----------------------------------------------------


def _resume(run: Run, actor: str) -> None:
    """resume_run wakes nothing in a run that waits for a person or works (and says nothing
    of it): the admin says so instead of reporting it resumed. A finished run is refused
    by resume_run itself."""
    if run.status not in TERMINAL and not has_something_to_resume(run):
        raise InvalidTransition(f"the run is {run.status}: nothing to resume")
    resume_run(run, actor=actor)


@admin.register(Run)
class RunAdmin(ReadOnlyAdmin, OperationsAdmin, TenantScopedAdmin):
    """Runs are read-only here (their writers are the executor and runtime.lifecycle); the
    two operations call lifecycle's writers, which journal in the run's stream."""

    list_display = ["run_id", "graph", "status", "attention_reason", "tenant", "updated_at"]
    list_filter = ["status", ("tenant", admin.RelatedOnlyFieldListFilter)]
    list_select_related = ["tenant"]
    ordering = ["-updated_at"]
    actions = ["resume_selected", "cancel_selected"]

    @admin.action(
        description="Resume selected runs (after needs attention, or wake a retrying one now)",
        permissions=["operate"],
    )
    def resume_selected(self, request: HttpRequest, queryset: QuerySet[Run]) -> None:
        self.operate(request, queryset, "Resumed", _resume)

    @admin.action(
        description="Cancel selected runs (unsent actions are withdrawn)", permissions=["operate"]
    )
    def cancel_selected(self, request: HttpRequest, queryset: QuerySet[Run]) -> None:
        reason = f"cancelled in the admin by {request.user.get_username()}"
        self.operate(
            request, queryset, "Cancelled", lambda run, actor: cancel_run(run, reason, actor=actor)
        )


# --- the journal ---------------------------------------------------------------------------
# Read-only, tenant-scoped, and cheap on millions of entries. It lives here, not in the audit
# app, because scoping it needs the tenants (`admin_tenants`), and audit imports neither
# `runtime` nor `approvals` (DESIGN.md, layering) — like the tenant audit log page
# (runtime.pages.audit).
#
# Nobody adds, changes or deletes history here (DESIGN.md, invariant 8): no add, change or
# delete permission, no actions. A tenant admin sees only the entries of the tenants they
# administer (invariant 9); operators (superusers) see all.
#
# On millions of rows the changelist avoids what would scan or sort the table: no
# full-result COUNT, a count capped for the paginator, a type filter with fixed choices
# instead of SELECT DISTINCT, exact (indexable) search instead of a substring LIKE, and no
# sorting by a clicked column.

# Paging past this many entries in admin is not what it is for: the audit log page pages
# through everything by keyset; here the count stops at this, and so does OFFSET.
COUNT_CAP = 10_000


class CappedCountPaginator(Paginator[JournalEntry]):
    """Counts at most COUNT_CAP rows: `SELECT COUNT(*) FROM (… LIMIT cap)` stays cheap."""

    object_list: QuerySet[JournalEntry]  # the changelist's (django-stubs: any sequence)

    @cached_property
    def count(self) -> int:
        return self.object_list[:COUNT_CAP].count()


class NewestFirst(ChangeList):
    """Always newest first: sorting millions of rows by a clicked column (`?o=`) would be a
    full sort; id order is what the indexes hold."""

    def get_ordering(self, request: HttpRequest, queryset: QuerySet[Any]) -> list[str | Combinable]:
        return ["-id"]


class TypeFilter(admin.SimpleListFilter):
    """Event types from the code's list, not SELECT DISTINCT type over the whole journal."""

    title = "type"
    parameter_name = "type"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(name, name) for name in KNOWN_TYPES]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        # A NUL never gets here: runtime.middleware.AdminQueryNul answers 400 before.
        return queryset.filter(type=value) if value else queryset


@admin.register(JournalEntry)
class JournalEntryAdmin(ReadOnlyAdmin):
    list_display = ["stream", "seq", "type", "actor", "created_at"]
    list_filter = [TypeFilter]
    search_fields = ["stream", "actor"]
    search_help_text = "Exact stream (run:<run id>, tenant:<id>) or exact actor (user:alice)."
    ordering = ["-id"]
    sortable_by = []  # no sort links on the column headers (see NewestFirst)
    actions = None
    show_full_result_count = False
    paginator = CappedCountPaginator

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return NewestFirst

    def get_queryset(self, request: HttpRequest) -> QuerySet[JournalEntry]:
        qs = super().get_queryset(request)
        if request.user.is_superuser:
            return qs
        # The ids, not a subquery: the planner then sees constants and uses the tenant indexes.
        tenant_ids = list(admin_tenants(request).values_list("pk", flat=True))
        return qs.filter(tenant_id__in=tenant_ids)

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        """Exact match: `icontains` would scan every row of the journal for each search."""
        term = search_term.strip()
        if not term:
            return queryset, False
        return queryset.filter(Q(stream=term) | Q(actor=term)), False


# --- operators' tables ---------------------------------------------------------------------


class OperatorOnly:
    """Operators' tables in admin: every tenant's users and groups, and the task queue (its
    payloads name every tenant's runs). Tenant admins hold no permission on them, and must
    not learn which rows exist either: Django's history view looks the object up *before* it
    checks permission (found → 403, missing → a redirect), an oracle for the ids of other
    tenants' users. For anyone but a superuser the queryset is empty, so every id reads as
    missing; the permission checks stay Django's (tests/security/test_admin_isolation.py)."""

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        qs: QuerySet[Any] = super().get_queryset(request)  # type: ignore[misc]
        return qs if request.user.is_superuser else qs.none()


def close_to_tenant_admins(*models: type[Any]) -> None:
    """Re-register each model's admin with `OperatorOnly` in front of it."""
    for model in models:
        current = type(admin.site.get_model_admin(model))
        admin.site.unregister(model)
        admin.site.register(model, type(current.__name__, (OperatorOnly, current), {}))


def _operator_tables() -> list[type[Any]]:
    from django.contrib.auth.models import Group
    from django_q.models import Failure, OrmQ, Schedule, Success

    return [User, Group, Schedule, Success, Failure, OrmQ]


close_to_tenant_admins(*_operator_tables())
