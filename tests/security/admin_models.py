"""Every model registered in Django admin: whose rows it holds, how the tests find a tenant's
object of it, and which views its admin URL patterns are (shared by the admin isolation
test and the no-state-change-through-GET test).

A model registered tomorrow fails those tests until it is listed here.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.apps import apps
from django.contrib import admin
from django.contrib.auth.models import Group
from django.db.models import Model, QuerySet
from django.utils import timezone
from django_q.models import OrmQ, Schedule, Task

from approvals.models import ApprovalRequest
from audit.models import JournalEntry
from runtime.models import (
    AgentAccount,
    AgentToken,
    McpServer,
    Membership,
    Role,
    Run,
    Tenant,
    ToolCredential,
    ToolDefinition,
)
from tests.security.matrix import Route
from tests.security.world import World


@dataclass(frozen=True)
class AdminModel:
    """How the tests find a tenant's object of a model, and which rows are the tenant's.

    `owned` is None for operators' tables: a tenant admin may not open them at all.
    """

    obj: Callable[[World], Model]
    owned: Callable[[Tenant], QuerySet[Any]] | None = None
    url_id: Callable[[Model], Any] = lambda obj: obj.pk
    missing: str | None = None  # an admin-URL id naming nothing, when not of the pk's type


def _task(world: World, success: bool) -> Task:
    now = timezone.now()
    return Task.objects.create(
        id=uuid.uuid4().hex,
        name=f"task-of-{world.slug}-{success}",
        func="runtime.tasks.advance",
        started=now,
        stopped=now,
        success=success,
    )


ADMIN_MODELS: dict[str, AdminModel] = {
    "runtime.Tenant": AdminModel(lambda w: w.tenant, lambda t: Tenant.objects.filter(pk=t.pk)),
    "runtime.Membership": AdminModel(
        lambda w: Membership.objects.get(user=w.reviewer.user, tenant=w.tenant),
        lambda t: Membership.objects.filter(tenant=t),
    ),
    "runtime.AgentAccount": AdminModel(
        lambda w: AgentAccount.objects.get(pk=w.agent.user.pk),
        lambda t: AgentAccount.objects.filter(memberships__tenant=t, memberships__role=Role.AGENT),
    ),
    "runtime.AgentToken": AdminModel(
        lambda w: AgentToken.objects.filter(user=w.agent.user).latest("pk"),
        lambda t: AgentToken.objects.filter(tenant=t),
    ),
    "runtime.ToolCredential": AdminModel(
        lambda w: w.credential, lambda t: ToolCredential.objects.filter(tenant=t)
    ),
    "runtime.ToolDefinition": AdminModel(
        lambda w: ToolDefinition.objects.get(tenant=w.tenant, name=w.tool_name),
        lambda t: ToolDefinition.objects.filter(tenant=t),
    ),
    "runtime.Run": AdminModel(
        lambda w: Run.objects.get(pk=w.run_id), lambda t: Run.objects.filter(tenant=t)
    ),
    "runtime.McpServer": AdminModel(
        lambda w: McpServer.objects.get_or_create(
            tenant=w.tenant, name="helpdesk", defaults={"url": "http://127.0.0.1:9/mcp"}
        )[0],
        lambda t: McpServer.objects.filter(tenant=t),
    ),
    "approvals.ApprovalPolicy": AdminModel(
        lambda w: w.policy,
        lambda t: apps.get_model("approvals.ApprovalPolicy").objects.filter(tenant=t),
    ),
    "approvals.ApprovalRequest": AdminModel(
        lambda w: ApprovalRequest.objects.get(pk=w.approval_id),
        lambda t: ApprovalRequest.objects.filter(tenant=t),
    ),
    "approvals.TenantWebhook": AdminModel(
        lambda w: w.webhook,
        lambda t: apps.get_model("approvals.TenantWebhook").objects.filter(tenant=t),
    ),
    "approvals.WebhookDelivery": AdminModel(
        lambda w: w.delivery,
        lambda t: apps.get_model("approvals.WebhookDelivery").objects.filter(webhook__tenant=t),
    ),
    "audit.JournalEntry": AdminModel(
        lambda w: JournalEntry.objects.filter(tenant_id=w.tenant.pk).latest("pk"),
        lambda t: JournalEntry.objects.filter(tenant_id=t.pk),
    ),
    # Operators' tables: every tenant's users and groups, and the task queue (whose payloads
    # name every tenant's runs). Closed to tenant admins.
    "auth.User": AdminModel(lambda w: w.reviewer.user),
    "auth.Group": AdminModel(lambda w: Group.objects.get(name=f"{w.slug}-reviewers")),
    "django_q.Schedule": AdminModel(
        lambda w: Schedule.objects.create(name=f"schedule-of-{w.slug}", func="runtime.x")
    ),
    "django_q.Success": AdminModel(lambda w: _task(w, True)),
    "django_q.Failure": AdminModel(lambda w: _task(w, False)),
    "django_q.OrmQ": AdminModel(
        lambda w: OrmQ.objects.create(key=f"q-of-{w.slug}", payload="x", lock=timezone.now())
    ),
}


def missing_id(model: type[Model]) -> str:
    """An id of the model's kind that names nothing."""
    pk = model._meta.pk
    if pk.get_internal_type() == "UUIDField":
        return str(uuid.uuid4())
    if pk.get_internal_type() in ("CharField", "TextField"):
        return uuid.uuid4().hex
    return "987654321"


MODEL_VIEWS = {
    "": "changelist",
    "add/": "add",
    "<path:object_id>/history/": "history",
    "<path:object_id>/delete/": "delete",
    "<path:object_id>/change/": "change",
    "<path:object_id>/": "object",
    "<path:object_id>/test/": "test",  # a tool definition's dry run
    "<id>/password/": "password",
}
OBJECT_VIEWS = {"history", "delete", "change", "object", "password", "test"}


def model_route(route: Route) -> tuple[str, str] | None:
    """(model label, view) of a per-model admin pattern; None for site-wide patterns."""
    for model in admin.site._registry:
        prefix = f"admin/{model._meta.app_label}/{model._meta.model_name}/"
        if route.pattern.startswith(prefix):
            rest = route.pattern[len(prefix) :]
            return model._meta.label, MODEL_VIEWS.get(rest, f"unknown:{rest}")
    return None
