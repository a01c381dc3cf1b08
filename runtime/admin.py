"""Django admin for operators and tenant admins.

Superusers (operators) see every tenant. A tenant admin — staff, not superuser, with an
`admin` membership — sees and edits only their own tenants' memberships, agent accounts
and tokens: every queryset and every foreign-key choice is narrowed by `admin_tenants()`,
so another tenant's object is absent (404 on its URL), not merely read-only.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.db import transaction
from django.db.models import ForeignKey, QuerySet
from django.forms import ModelChoiceField
from django.http import HttpRequest
from rest_framework.authtoken.admin import TokenAdmin as DrfTokenAdmin
from rest_framework.authtoken.models import Token, TokenProxy

from runtime.accounts import record_tenant_act
from runtime.models import AgentAccount, Membership, Role, Tenant

User = get_user_model()


def admin_tenants(request: HttpRequest) -> QuerySet[Tenant]:
    if request.user.is_superuser:
        return Tenant.objects.all()
    return Tenant.objects.filter(
        memberships__user=request.user, memberships__role=Role.ADMIN, active=True
    )


def admin_users(request: HttpRequest) -> QuerySet[Any]:
    """Users a tenant admin may see: members of the tenants they administer."""
    if request.user.is_superuser:
        return User.objects.all()
    return User.objects.filter(memberships__tenant__in=admin_tenants(request)).distinct()


class AuditedAdmin(admin.ModelAdmin):
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


class TenantScopedAdmin(AuditedAdmin):
    """Narrows the changelist, the change form and every FK choice to the admin's tenants."""

    tenant_path = "tenant"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        qs = super().get_queryset(request)
        if request.user.is_superuser:
            return qs
        return qs.filter(**{f"{self.tenant_path}__in": admin_tenants(request)}).distinct()

    def formfield_for_foreignkey(
        self, db_field: ForeignKey, request: HttpRequest, **kwargs: Any
    ) -> ModelChoiceField | None:
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

    def tenant_of(self, obj: Any) -> int | None:
        return obj.pk

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        # Only operators create, rename the slug of, or deactivate tenants.
        return [] if request.user.is_superuser else ["slug", "active"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return request.user.is_superuser

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return request.user.is_superuser


class MembershipForm(forms.ModelForm):
    class Meta:
        model = Membership
        fields = ["tenant", "user", "role"]

    def clean(self) -> dict[str, Any]:
        data = super().clean()
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


class AgentAccountForm(forms.ModelForm):
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

    def get_form(self, request: HttpRequest, obj: Any = None, **kwargs: Any) -> Any:
        form = super().get_form(request, obj, **kwargs)
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


admin.site.unregister(TokenProxy)


@admin.register(TokenProxy)
class ScopedTokenAdmin(DrfTokenAdmin):
    """DRF's token admin, limited to tokens of agent accounts in the admin's tenants."""

    # DRF's autocomplete would query the global user admin, listing every tenant's users.
    autocomplete_fields = ()

    def get_queryset(self, request: HttpRequest) -> QuerySet[Token]:
        qs = super().get_queryset(request)
        if request.user.is_superuser:
            return qs
        return qs.filter(
            user__memberships__tenant__in=admin_tenants(request),
            user__memberships__role=Role.AGENT,
        ).distinct()

    def formfield_for_foreignkey(
        self, db_field: ForeignKey, request: HttpRequest, **kwargs: Any
    ) -> ModelChoiceField | None:
        if db_field.name == "user" and not request.user.is_superuser:
            kwargs["queryset"] = User.objects.filter(
                memberships__tenant__in=admin_tenants(request), memberships__role=Role.AGENT
            ).distinct()
        return super().formfield_for_foreignkey(db_field, request, **kwargs)
