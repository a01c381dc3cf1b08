"""Django admin for hold points: policies, requests (read-only), webhooks and deliveries.

Operations (admin actions calling the domain's writers, which journal): re-notify or
reassign a pending request (`approvals.notify.renotify`, `approvals.requests.
reassign_request`), redeliver a webhook message (`approvals.notify.redeliver`).

Scoped like `runtime.admin`: a tenant admin (staff, not superuser) sees only their tenants'
rows, and every choice — tenant, reviewer group, escalation group — is narrowed to them, so
another tenant's object is absent, not merely read-only. Requests are read-only for
everyone: they change only through `approvals.decisions` (decide once, journalled), never
through a form. Policy and webhook changes are written to the tenant's journal stream,
because who may decide is exactly what an auditor asks about.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.auth.models import Group
from django.db import transaction
from django.db.models import ForeignKey, Q, QuerySet
from django.forms import ModelChoiceField
from django.http import HttpRequest
from django.template.response import TemplateResponse
from guardian.shortcuts import remove_perm

from approvals import conditions
from approvals.models import (
    WEBHOOK_EVENTS,
    ApprovalPolicy,
    ApprovalRequest,
    PolicyGroupPermission,
    TenantWebhook,
    WebhookDelivery,
)
from approvals.notify import reach, redeliver, renotify
from approvals.policies import DECIDE, grant
from approvals.requests import reassign_request, wrong_tool
from audit import journal
from runtime import outbound
from runtime.admin import OperationsAdmin, ReadOnlyAdmin, TenantScopedAdmin, admin_tenants
from runtime.models import Tenant
from runtime.models.limits import NOTE_MAX

# Not a tenant's group even when a tenant's slug would prefix it ("tenant-admins").
GLOBAL_GROUPS = ("tenant-admins",)


def group_owner(name: str, slugs: Iterable[str]) -> str | None:
    """The tenant slug a group belongs to: the longest slug `s` with name `s-…`.

    Longest, so `acme-corp-reviewers` belongs to tenant `acme-corp`, not to `acme`. Until
    groups carry a tenant, the name is the only link (e.g. `acme-reviewers`).
    """
    if name in GLOBAL_GROUPS:
        return None
    owners = [slug for slug in slugs if name.startswith(f"{slug}-")]
    return max(owners, key=len) if owners else None


def tenant_groups(tenants: Iterable[Tenant] | QuerySet[Tenant]) -> QuerySet[Group]:
    """Groups owned by these tenants (see `group_owner`), for choices and for validation."""
    wanted = {tenant.slug for tenant in tenants}
    if not wanted:
        return Group.objects.none()
    prefix = Q()
    for slug in wanted:
        prefix |= Q(name__startswith=f"{slug}-")
    every_slug = list(Tenant.objects.values_list("slug", flat=True))
    # startswith is case-insensitive on SQLite; group_owner's check is exact on both.
    ids = [
        pk
        for pk, name in Group.objects.filter(prefix).values_list("pk", "name")
        if group_owner(name, every_slug) in wanted
    ]
    return Group.objects.filter(pk__in=ids).order_by("name")


def granted_groups(policy: ApprovalPolicy) -> QuerySet[Group]:
    """Groups holding the decide permission on this very policy."""
    ids = PolicyGroupPermission.objects.filter(
        content_object=policy, permission__codename=DECIDE
    ).values_list("group_id", flat=True)
    return Group.objects.filter(pk__in=ids)


def _actor(request: HttpRequest) -> str:
    return f"user:{request.user.get_username()}"


def _changed(form: forms.ModelForm[Any], change: bool) -> list[str]:
    return sorted(form.changed_data) if change else ["created"]


# --- policies ------------------------------------------------------------------------------


class ConditionField(forms.JSONField):
    """The policy's condition as a tenant admin edits it: no condition is an empty box
    saying "(always)", not the word `null` (issue 20), and the help states the language."""

    def prepare_value(self, value: Any) -> Any:
        if value is None or value == {}:
            return ""
        return super().prepare_value(value)


class ApprovalPolicyForm(forms.ModelForm[ApprovalPolicy]):
    condition = ConditionField(
        required=False,
        help_text=conditions.HELP,
        widget=forms.Textarea(
            attrs={"rows": 3, "placeholder": f"{conditions.ALWAYS} — every action of the tool"}
        ),
    )
    decider_groups = forms.ModelMultipleChoiceField(
        queryset=Group.objects.none(),
        required=False,
        widget=forms.CheckboxSelectMultiple,
        help_text="Reviewer groups of this tenant whose members may decide under this policy.",
    )
    # Set per request by ApprovalPolicyAdmin.get_form (never on the shared field object).
    group_choices: QuerySet[Group] = Group.objects.none()

    class Meta:
        model = ApprovalPolicy
        fields = [
            "tenant",
            "name",
            "tool",
            "condition",
            "required",
            "quorum",
            "separation_of_duties",
            "expiry_seconds",
            "on_expiry",
            "remind_before_seconds",
            "escalate_after_seconds",
            "escalation_group",
            "priority",
            "active",
        ]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        deciders = self.fields["decider_groups"]
        assert isinstance(deciders, forms.ModelMultipleChoiceField)  # declared above
        deciders.queryset = self.group_choices
        if self.instance.pk:
            self.initial["decider_groups"] = list(
                granted_groups(self.instance).values_list("pk", flat=True)
            )

    def clean_condition(self) -> Any:
        """Empty means every action of the tool; the model's `clean` checks the rest
        (`approvals.conditions.check`: the shape, the op, patterns RE2 can run)."""
        condition = self.cleaned_data.get("condition")
        return None if condition in (None, {}, "") else condition

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data
        tenant = data.get("tenant") or (self.instance.tenant if self.instance.pk else None)
        if tenant is None:
            return data
        name = data.get("name")
        if "tenant" not in self.fields and name:
            # With tenant read-only, Django skips the (tenant, name) unique check: do it here
            # rather than let the database refuse it with a server error.
            twins = ApprovalPolicy.objects.filter(tenant=tenant, name=name)
            if twins.exclude(pk=self.instance.pk).exists():
                self.add_error("name", f"{tenant.slug} already has a policy with this name")
        own = set(tenant_groups([tenant]).values_list("pk", flat=True))
        foreign = [g.name for g in data.get("decider_groups") or [] if g.pk not in own]
        if foreign:
            self.add_error("decider_groups", f"not groups of {tenant.slug}: {', '.join(foreign)}")
        escalation = data.get("escalation_group")
        if escalation is not None and escalation.pk not in own:
            self.add_error("escalation_group", f"not a group of {tenant.slug}")
        return data


@admin.register(ApprovalPolicy)
class ApprovalPolicyAdmin(TenantScopedAdmin):
    form = ApprovalPolicyForm
    list_display = [
        "tool",
        "name",
        "condition_shown",
        "required",
        "quorum",
        "expiry_seconds",
        "on_expiry",
        "active",
        "tenant",
    ]
    list_filter = ["active", "required", "on_expiry"]
    search_fields = ["name", "tool"]
    fieldsets = [
        (None, {"fields": ["tenant", "name", "tool", "condition", "priority", "active"]}),
        (
            "Who decides",
            {"fields": ["required", "decider_groups", "quorum", "separation_of_duties"]},
        ),
        (
            "Time",
            {
                "fields": [
                    "expiry_seconds",
                    "on_expiry",
                    "remind_before_seconds",
                    "escalate_after_seconds",
                    "escalation_group",
                ]
            },
        ),
    ]

    @admin.display(description="condition")
    def condition_shown(self, policy: ApprovalPolicy) -> str:
        return conditions.describe(policy.condition)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        # Moving a policy to another tenant would carry its grants along: create a new one.
        return ["tenant"] if obj is not None else []

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> type[forms.ModelForm[Any]]:
        form = super().get_form(request, obj, change=change, **kwargs)
        tenants = [obj.tenant] if obj is not None else admin_tenants(request)
        # A subclass per request: assigning the queryset on the class's field object would
        # be shared by concurrent requests of other tenants' admins.
        return type(form.__name__, (form,), {"group_choices": tenant_groups(tenants)})

    def formfield_for_foreignkey(
        self, db_field: ForeignKey[Any, Any], request: HttpRequest, **kwargs: Any
    ) -> ModelChoiceField[Any] | None:
        if db_field.name == "escalation_group":
            kwargs["queryset"] = tenant_groups(admin_tenants(request))
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def save_related(self, request: HttpRequest, form: Any, formsets: Any, change: bool) -> None:
        """Grant and revoke the decide permission to match the ticked groups.

        Only groups the admin can see are revoked: a grant an operator made to a group
        outside the tenant's naming survives a tenant admin's save.
        """
        super().save_related(request, form, formsets, change)
        policy: ApprovalPolicy = form.instance
        visible = set(form.fields["decider_groups"].queryset)
        chosen = set(form.cleaned_data.get("decider_groups") or [])
        current = set(granted_groups(policy))
        added = sorted(chosen - current, key=lambda g: g.name)
        removed = sorted((current & visible) - chosen, key=lambda g: g.name)
        for group in added:
            grant(policy, group)
        for group in removed:
            remove_perm(DECIDE, group, policy)
        changed = _changed(form, change)
        if changed or added or removed:
            journal.append(
                journal.tenant_stream(policy.tenant_id),
                "policy_changed",
                tenant_id=policy.tenant_id,
                actor=_actor(request),
                object_ref=f"approvalpolicy:{policy.pk}",
                payload={
                    "policy": policy.name,
                    "tool": policy.tool,
                    "changed": [f for f in changed if f != "decider_groups"],
                    "granted": [g.name for g in added],
                    "revoked": [g.name for g in removed],
                },
            )


# --- requests: read-only -------------------------------------------------------------------


class ReassignForm(forms.Form):
    """The reassign action's page: a policy of the selected requests' tenant and tool."""

    policy = forms.ModelChoiceField(queryset=ApprovalPolicy.objects.none())
    reason = forms.CharField(max_length=NOTE_MAX, required=False, widget=forms.Textarea)

    def __init__(
        self,
        *args: Any,
        policies: QuerySet[ApprovalPolicy],
        selected: QuerySet[ApprovalRequest],
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        choice = self.fields["policy"]
        assert isinstance(choice, forms.ModelChoiceField)  # declared above
        choice.queryset = policies  # a per-instance field: never shared between requests
        self.selected = selected

    def clean_policy(self) -> ApprovalPolicy:
        """The writer's own rule (`wrong_tool`), asked of the whole selection first: a form
        error on the page, not a refusal per row after the others were reassigned."""
        policy: ApprovalPolicy = self.cleaned_data["policy"]
        tools = sorted(set(self.selected.values_list("action__tool", flat=True)))
        one = self.selected.count() == 1
        whose = "this request's action" if one else "a selected request's action"
        for tool in tools:
            problem = wrong_tool(policy, tool, whose=whose)
            if problem:
                raise forms.ValidationError(problem)
        return policy


@admin.register(ApprovalRequest)
class ApprovalRequestAdmin(ReadOnlyAdmin, OperationsAdmin, TenantScopedAdmin):
    list_display = [
        "title",
        "status",
        "expires_at",
        "policy",
        "decision",
        "decided_by",
        "escalated",
        "tenant",
        "created_at",
    ]
    # RelatedOnly: choices come from the scoped queryset; a plain FK filter would list
    # every tenant's policies.
    list_filter = [
        "status",
        "escalated",
        ("policy", admin.RelatedOnlyFieldListFilter),
        ("tenant", admin.RelatedOnlyFieldListFilter),
    ]
    list_select_related = ["tenant", "policy", "decided_by"]
    search_fields = ["title"]
    ordering = ["-expires_at"]
    actions = ["renotify_selected", "reassign_selected"]

    @admin.action(
        description="Re-notify who may decide the selected pending requests",
        permissions=["operate"],
    )
    def renotify_selected(self, request: HttpRequest, queryset: QuerySet[ApprovalRequest]) -> None:
        self.operate(request, queryset, "Re-notified", renotify)

    @admin.action(
        description="Reassign the selected pending requests to another policy…",
        permissions=["operate"],
    )
    def reassign_selected(
        self, request: HttpRequest, queryset: QuerySet[ApprovalRequest]
    ) -> TemplateResponse | None:
        """A page to pick the policy (of the requests' one tenant), then reassign_request."""
        tenants = set(queryset.values_list("tenant_id", flat=True))
        if len(tenants) != 1:
            self.message_user(request, "Select requests of one tenant.", messages.ERROR)
            return None
        policies = ApprovalPolicy.objects.filter(tenant_id__in=tenants, active=True)
        form = ReassignForm(
            request.POST if "apply" in request.POST else None,
            policies=policies,
            selected=queryset,
        )
        if form.is_valid():
            policy, reason = form.cleaned_data["policy"], form.cleaned_data["reason"]
            self.operate(
                request,
                queryset,
                "Reassigned",
                lambda item, actor: reassign_request(item, policy, actor, reason),
            )
            return None
        context = {
            **self.admin_site.each_context(request),
            "title": "Reassign approval requests",
            "opts": self.model._meta,
            "form": form,
            "selected": queryset,
            "checkbox": helpers.ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, "admin/approvals/reassign.html", context)


# --- webhooks ------------------------------------------------------------------------------


class TenantWebhookForm(forms.ModelForm[TenantWebhook]):
    event_types = forms.MultipleChoiceField(
        choices=[(event, event) for event in WEBHOOK_EVENTS],
        initial=list(WEBHOOK_EVENTS),
        widget=forms.CheckboxSelectMultiple,
    )
    url = forms.URLField(
        max_length=500,
        assume_scheme="https",
        help_text="Receives a signed POST per event (Standard Webhooks).",
    )

    class Meta:
        model = TenantWebhook
        fields = ["tenant", "url", "active", "event_types"]

    def clean_url(self) -> str:
        """What the sender would refuse of the URL itself (scheme, credentials in it, a
        non-ASCII host), said now; its addresses are judged at each delivery."""
        url: str = self.cleaned_data["url"]
        try:
            outbound.check_url(url, reach())
        except outbound.OutboundRefused as refused:
            raise forms.ValidationError(refused.detail) from None
        return url


@admin.register(TenantWebhook)
class TenantWebhookAdmin(TenantScopedAdmin):
    form = TenantWebhookForm
    list_display = ["url", "tenant", "active", "events", "created_at"]
    list_filter = ["active"]
    search_fields = ["url"]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        # The secret is generated on creation and shown here to copy into the receiver.
        return ["tenant", "secret", "created_at"] if obj is not None else []

    @admin.display(description="events")
    def events(self, obj: TenantWebhook) -> str:
        return ", ".join(obj.event_types or [])

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        super().save_model(request, obj, form, change)
        journal.append(
            journal.tenant_stream(obj.tenant_id),
            "webhook_changed",
            tenant_id=obj.tenant_id,
            actor=_actor(request),
            object_ref=f"tenantwebhook:{obj.pk}",
            payload={"url": obj.url, "active": obj.active, "changed": _changed(form, change)},
        )
        if not change:
            self.message_user(
                request, "Webhook created: open it to copy its signing secret into the receiver."
            )

    def delete_model(self, request: HttpRequest, obj: Any) -> None:
        tenant_id, pk, url = obj.tenant_id, obj.pk, obj.url
        super().delete_model(request, obj)
        journal.append(
            journal.tenant_stream(tenant_id),
            "webhook_deleted",
            tenant_id=tenant_id,
            actor=_actor(request),
            object_ref=f"tenantwebhook:{pk}",
            payload={"url": url},
        )

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        # The changelist's bulk delete runs outside the admin's transaction; the journal
        # entries must commit with the deletions.
        with transaction.atomic():
            for obj in queryset:
                self.delete_model(request, obj)


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(ReadOnlyAdmin, OperationsAdmin, TenantScopedAdmin):
    tenant_path = "webhook__tenant"
    list_display = [
        "created_at",
        "event_type",
        "message_id",
        "attempt",
        "status_code",
        "short_error",
        "next_attempt_at",
        "webhook",
    ]
    list_filter = ["event_type", "status_code"]
    list_select_related = ["webhook__tenant"]
    search_fields = ["message_id"]
    actions = ["redeliver_selected"]

    @admin.action(
        description="Redeliver the selected messages (same id and body, a new attempt)",
        permissions=["operate"],
    )
    def redeliver_selected(self, request: HttpRequest, queryset: QuerySet[WebhookDelivery]) -> None:
        self.operate(request, queryset, "Queued for redelivery", redeliver)

    @admin.display(description="error")
    def short_error(self, obj: WebhookDelivery) -> str:
        return obj.error[:80]
