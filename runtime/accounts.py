"""Human and admin acts recorded in each tenant's stream (DESIGN.md, "Journal").

Logins, failed logins and token changes have no single call site we own (Django's login view,
DRF's drf_create_token command, the admin), so Django's own signals are the hook; each handler
only calls `record_tenant_act`, the one function that writes these entries.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.signals import user_logged_in, user_login_failed
from django.db import transaction
from django.db.models.signals import post_delete, post_save
from django.http import HttpRequest
from rest_framework.authtoken.models import Token

from audit import journal
from runtime.models import Membership


def record_tenant_act(tenant_id: int, type: str, actor: str, **payload: Any) -> None:
    with transaction.atomic():
        journal.append(
            journal.tenant_stream(tenant_id),
            type,
            tenant_id=tenant_id,
            actor=actor,
            payload=payload,
        )


def _tenants_of(user: Any) -> list[int]:
    return list(Membership.objects.filter(user=user).values_list("tenant_id", flat=True))


def _client(request: HttpRequest | None) -> dict[str, str]:
    if request is None:
        return {}
    return {
        "ip": request.META.get("REMOTE_ADDR", ""),
        "user_agent": request.META.get("HTTP_USER_AGENT", "")[:200],
    }


def on_login(sender: Any, request: HttpRequest | None, user: Any, **kwargs: Any) -> None:
    for tenant_id in _tenants_of(user):
        record_tenant_act(tenant_id, "login", f"user:{user.get_username()}", **_client(request))


def on_login_failed(
    sender: Any, credentials: dict[str, Any], request: HttpRequest | None = None, **kwargs: Any
) -> None:
    username = str(credentials.get("username", ""))[:150]
    user = get_user_model().objects.filter(username=username).first()
    if user is None:
        return  # no tenant to tell; the web server's log has it
    for tenant_id in _tenants_of(user):
        record_tenant_act(tenant_id, "login_failed", f"user:{username}", **_client(request))


def on_token_saved(sender: Any, instance: Token, created: bool, **kwargs: Any) -> None:
    if created:
        for tenant_id in _tenants_of(instance.user):
            record_tenant_act(
                tenant_id,
                "token_created",
                "system:accounts",
                agent=instance.user.get_username(),
                token_prefix=instance.key[:4],
            )


def on_token_deleted(sender: Any, instance: Token, **kwargs: Any) -> None:
    for tenant_id in _tenants_of(instance.user):
        record_tenant_act(
            tenant_id,
            "token_revoked",
            "system:accounts",
            agent=instance.user.get_username(),
            token_prefix=instance.key[:4],
        )


def connect() -> None:
    user_logged_in.connect(on_login, dispatch_uid="holdpoint.login")
    user_login_failed.connect(on_login_failed, dispatch_uid="holdpoint.login_failed")
    post_save.connect(on_token_saved, sender=Token, dispatch_uid="holdpoint.token_saved")
    post_delete.connect(on_token_deleted, sender=Token, dispatch_uid="holdpoint.token_deleted")
