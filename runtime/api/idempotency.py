"""Idempotency-Key for creating POSTs (brandur / Stripe style, API.md "Conventions").

The key is claimed in its own transaction before the work (a concurrent duplicate finds it
in flight: 409), the response is stored with the request's fingerprint after the work
(same key + same body → the first response again; a different body → 422), and a request
that failed validation gives its key back, so the client can fix the body and retry.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.http import HttpResponse
from django.utils import timezone
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response

from audit.canonical import digest
from runtime.errors import Conflict, HoldpointError, InvalidParams
from runtime.models import IdempotencyRecord, Tenant


class KeyReused(InvalidParams):
    code = "idempotency_key_reused"
    title = "This Idempotency-Key was used with a different request"


class KeyInFlight(Conflict):
    code = "idempotency_key_in_flight"
    title = "A request with this Idempotency-Key is still being processed"


def idempotent(view: Callable[..., Response]) -> Callable[..., HttpResponse]:
    """Wrap a creating POST handler `(self, request, *args, **kwargs)`. A replay answers with
    the stored bytes: a plain HttpResponse, not a DRF Response."""

    def wrapper(self: Any, request: Request, *args: Any, **kwargs: Any) -> HttpResponse:
        key = request.headers.get("Idempotency-Key")
        if not key:
            return view(self, request, *args, **kwargs)
        if len(key) > 255 or not key.isprintable():
            raise InvalidParams(
                "Idempotency-Key must be 1-255 printable characters",
                errors={"Idempotency-Key": ["invalid"]},
            )
        tenant = self.principal(request).tenant
        scope = f"{request.method} {request.path}"
        fingerprint = digest({"scope": scope, "body": request.data})
        record = _claim(tenant, key, scope, fingerprint)
        if record.status is not None:
            return _replay(record)
        try:
            response = view(self, request, *args, **kwargs)
        except HoldpointError as exc:
            if exc.status < 500:
                IdempotencyRecord.objects.filter(pk=record.pk).delete()  # key given back
            raise
        except Exception:
            IdempotencyRecord.objects.filter(pk=record.pk).delete()
            raise
        if response.status_code < 300:
            content = JSONRenderer().render(response.data).decode()
            IdempotencyRecord.objects.filter(pk=record.pk).update(
                status=response.status_code, content=content
            )
        else:
            IdempotencyRecord.objects.filter(pk=record.pk).delete()
        return response

    wrapper.__name__ = view.__name__
    wrapper.__doc__ = view.__doc__
    return wrapper


def _replay(record: IdempotencyRecord) -> HttpResponse:
    """The first response's bytes, as they were sent (the renderer is DRF's JSONRenderer,
    the one that rendered the original)."""
    response = HttpResponse(
        record.content or "", status=record.status, content_type="application/json"
    )
    response["Idempotent-Replayed"] = "true"
    return response


def expire_keys(*, dry_run: bool = False) -> int:
    """Forget stored responses older than the retention window (the purge command calls
    this): past the window a key is free again anyway, so the rows only cost space."""
    window = timedelta(hours=settings.HOLDPOINT_IDEMPOTENCY_HOURS)
    old = IdempotencyRecord.objects.filter(created_at__lt=timezone.now() - window)
    if dry_run:
        return old.count()
    return old.delete()[0]


def _claim(tenant: Tenant, key: str, scope: str, fingerprint: str) -> IdempotencyRecord:
    window = timedelta(hours=settings.HOLDPOINT_IDEMPOTENCY_HOURS)
    IdempotencyRecord.objects.filter(
        tenant=tenant, key=key, created_at__lt=timezone.now() - window
    ).delete()
    try:
        with transaction.atomic():
            return IdempotencyRecord.objects.create(
                tenant=tenant, key=key, scope=scope, fingerprint=fingerprint
            )
    except IntegrityError:
        existing = IdempotencyRecord.objects.get(tenant=tenant, key=key)
    if existing.fingerprint != fingerprint:
        raise KeyReused("same Idempotency-Key, different request")
    if existing.status is None:
        raise KeyInFlight("the first request with this key has not finished; retry later")
    return existing
