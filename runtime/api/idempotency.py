"""Idempotency-Key for creating POSTs (brandur / Stripe style, API.md "Conventions").

The key is claimed in its own transaction before the work (a concurrent duplicate finds it
in flight: 409), the response is stored with the request's fingerprint after the work
(same key + same body → the first response again; a different body → 422), and a request
that failed validation gives its key back, so the client can fix the body and retry.

A key is one caller's: the record names who claimed it (`principal`: the user behind the
token or session), and the same key from another caller of the tenant is 422 key reuse even
with the same body — a replay hands over the first caller's response (and, past a dead
claim, its effect), which the second caller's own rights were never checked for.

A request can die holding its claim (SIGKILL, OOM, a deploy, its database connection lost
so that it cannot give the key back). So a claim is a lease with a fence: it holds until
`claimed_until` (database time, HOLDPOINT_IDEMPOTENCY_CLAIM_SECONDS, longer than any of
these requests takes); past it a retry with the same key and body takes it over,
compare-and-swap on `claim`, so two retries do not both take it. The effect is recorded on
the claim in the effect's own transaction (`Claim.settle`, which the domain function calls
inside it): a retry that takes over a claim whose effect committed answers with that effect
and does nothing again; one whose effect did not commit does the work. `settle` is
conditional on the claim's fence: a request still running past its lease, overtaken by a
retry, fails there and its effect rolls back (409 idempotency_key_in_flight) — never two
effects, never a write over its successor's record.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import DatabaseError, IntegrityError, connection, transaction
from django.db.models import Q
from django.db.models.functions import Now
from django.http import HttpResponse
from django.utils import timezone
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response

from audit.canonical import digests
from runtime.errors import Conflict, InvalidParams
from runtime.faults import FaultPoint, fault
from runtime.leases import db_now_plus
from runtime.models import IdempotencyRecord, Tenant

log = logging.getLogger("holdpoint.api")

# What a domain function calls inside its effect's transaction: (the effect's id, created).
Settle = Callable[[Any, bool], None]


class KeyReused(InvalidParams):
    code = "idempotency_key_reused"
    title = "This Idempotency-Key was used with a different request"


class KeyInFlight(Conflict):
    """The one 409 a client should retry (API.md): `Retry-After` says when, as a 429 or a
    503 does — the first request is usually done within a second, and a claim it died
    holding is taken over after HOLDPOINT_IDEMPOTENCY_CLAIM_SECONDS."""

    code = "idempotency_key_in_flight"
    title = "A request with this Idempotency-Key is still being processed"
    retry_after = 1


@dataclass(frozen=True)
class Claim:
    """This request's hold on its key: the record and the fence it was claimed with."""

    pk: int
    fence: int

    def settle(self, effect: Any, created: bool = True) -> None:
        """Record the effect on the claim — call it inside the effect's transaction, so the
        two commit together. A claim taken over meanwhile raises: the effect rolls back."""
        mine = IdempotencyRecord.objects.filter(pk=self.pk, claim=self.fence, effect="")
        if mine.update(effect=str(effect), effect_created=created) != 1:
            raise KeyInFlight("a retry with this Idempotency-Key took the request over")

    def complete(self, response: Response) -> str:
        """Store the response to replay (after the effect committed); its bytes."""
        content = JSONRenderer().render(response.data).decode()
        self.mine().update(status=response.status_code, content=content)
        return content

    def release(self) -> None:
        """The request failed: give the key back if its effect did not commit (so the
        client can fix the body and retry), else end the claim so a retry answers with the
        effect at once. A lost connection is retried once on a new one; if that fails too
        the claim's lease ends it."""
        for attempt in (1, 2):
            try:
                self.mine().filter(effect="").delete()
                self.mine().update(claimed_until=Now())
                return
            except DatabaseError:
                if attempt == 2 or connection.in_atomic_block:
                    log.warning("Idempotency-Key claim %s kept until its lease ends", self.pk)
                    return
                connection.close()

    def mine(self) -> Any:
        """The record while this claim holds it and no response is stored."""
        return IdempotencyRecord.objects.filter(pk=self.pk, claim=self.fence, status=None)


def settler(request: Request) -> Settle | None:
    """The claim's `settle` for the domain function the view calls (None: no key given)."""
    claim: Claim | None = getattr(request, "idempotency_claim", None)
    return claim.settle if claim is not None else None


def idempotent(view: Callable[..., Response]) -> Callable[..., HttpResponse]:
    """Wrap a creating POST handler `(self, request, *args, **kwargs)` whose domain function
    takes `settle=settler(request)`; the view class answers for a recorded effect with
    `effect_response(request, effect, created, *args, **kwargs)`. A replay answers with the
    stored bytes: a plain HttpResponse, not a DRF Response."""

    def wrapper(self: Any, request: Request, *args: Any, **kwargs: Any) -> HttpResponse:
        key = request.headers.get("Idempotency-Key")
        if not key:
            return view(self, request, *args, **kwargs)
        if len(key) > 255 or not key.isprintable():
            raise InvalidParams(
                "Idempotency-Key must be 1-255 printable characters",
                errors={"Idempotency-Key": ["invalid"]},
            )
        principal = self.principal(request)
        scope = f"{request.method} {request.path}"
        fingerprints = digests({"scope": scope, "body": request.data})
        record = _claim(principal.tenant, principal.user.pk, key, scope, fingerprints)
        if record.status is not None:
            return _replay(record.status, record.content)
        claim = Claim(record.pk, record.claim)
        if record.effect:  # taken over from a request that died after its effect committed
            answer = self.effect_response(
                request, record.effect, record.effect_created, *args, **kwargs
            )
            return _replay(answer.status_code, claim.complete(answer))
        setattr(request, "idempotency_claim", claim)  # noqa: B010 (DRF Request has no slot)
        fault(FaultPoint.AFTER_KEY_CLAIMED)
        try:
            response = view(self, request, *args, **kwargs)
        except Exception:
            claim.release()
            raise
        if response.status_code >= 300:
            claim.release()
            return response
        fault(FaultPoint.BEFORE_KEY_RESPONSE)
        claim.complete(response)
        return response

    wrapper.__name__ = view.__name__
    wrapper.__doc__ = view.__doc__
    return wrapper


def _replay(status: int, content: str | None) -> HttpResponse:
    """The first response's bytes, as they were sent (the renderer is DRF's JSONRenderer,
    the one that rendered the original)."""
    response = HttpResponse(content or "", status=status, content_type="application/json")
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


def _claim(
    tenant: Tenant, principal: int, key: str, scope: str, fingerprints: tuple[str, ...]
) -> IdempotencyRecord:
    """The record of this key: claimed now for this request, or the earlier request's —
    only if it was the same caller's (`principal`: a user's pk) and the same request.
    `fingerprints`: the request's, RFC 8785's first (stored), then the one a record made
    before Holdpoint wrote RFC 8785 holds for the same request where that differs
    (audit.canonical.digests): a retry across that upgrade is the same request."""
    window = timedelta(hours=settings.HOLDPOINT_IDEMPOTENCY_HOURS)
    IdempotencyRecord.objects.filter(
        tenant=tenant, key=key, created_at__lt=timezone.now() - window
    ).delete()
    lease = db_now_plus(settings.HOLDPOINT_IDEMPOTENCY_CLAIM_SECONDS)
    try:
        with transaction.atomic():
            return IdempotencyRecord.objects.create(
                tenant=tenant,
                principal_id=principal,
                key=key,
                scope=scope,
                fingerprint=fingerprints[0],
                claimed_until=lease,
            )
    except IntegrityError:
        existing = IdempotencyRecord.objects.get(tenant=tenant, key=key)
    if existing.principal_id is not None and existing.principal_id != principal:
        # Checked before anything of the first request is looked at or taken over; a null
        # principal is a record from before the column, replayed as it was then.
        raise KeyReused("this Idempotency-Key was used by another caller of the tenant")
    if existing.fingerprint not in fingerprints:
        raise KeyReused("same Idempotency-Key, different request")
    if existing.status is None:
        return _take_over(existing)
    return existing


def _take_over(existing: IdempotencyRecord) -> IdempotencyRecord:
    """The claim of a request that can no longer be running, moved on to this one
    (compare-and-swap on its fence: of two retries racing for it, one gets it)."""
    lease = db_now_plus(settings.HOLDPOINT_IDEMPOTENCY_CLAIM_SECONDS)
    dead = Q(claimed_until__lt=Now()) | Q(claimed_until=None)
    taken = IdempotencyRecord.objects.filter(
        dead, pk=existing.pk, claim=existing.claim, status=None
    ).update(claim=existing.claim + 1, claimed_until=lease)
    if taken != 1:
        again = IdempotencyRecord.objects.filter(pk=existing.pk).first()
        if again is not None and again.status is not None:
            return again  # it finished meanwhile: its response
        raise KeyInFlight("the first request with this key has not finished; retry later")
    return IdempotencyRecord.objects.get(pk=existing.pk)
