"""API tokens: authenticating a request, and issuing, rotating and revoking tokens.

`AgentTokenAuthentication` reads `Authorization: Token <key>` (the header DRF's own token
scheme used, so clients did not change) and looks the key's sha256 up among usable tokens
in one query on every request — no cache, so a revocation, a deactivated user, a removed
membership or a deactivated tenant refuses the very next request, in any process. Every
refusal reads the same ("Invalid token."), whatever the reason: no oracle for which keys
once existed.

Issue, rotate and revoke are the only ways tokens change; each writes its journal entry in
the tenant's stream in the same transaction (the admin, `manage.py agent_token` and tests
only call them). Journal entries name the token by its prefix, never its key or hash.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.request import Request

from runtime import logs
from runtime.accounts import outlived, record_tenant_act
from runtime.models import AgentToken, Membership, Role, Tenant
from runtime.models.tokens import PREFIX_LENGTH, hash_key, new_key
from runtime.tenancy import Principal, principal_for

KEYWORD = "Token"
# How long the old token keeps working after a rotation, unless told otherwise: long enough
# for every process of an agent to pick the new key up on its next deploy or restart.
DEFAULT_OVERLAP = timedelta(hours=24)


class AgentTokenAuthentication(BaseAuthentication):
    """DRF authentication by agent token (runtime.models.AgentToken)."""

    def authenticate(self, request: Request) -> tuple[User, AgentToken] | None:
        parts = get_authorization_header(request).split()
        if not parts or parts[0].lower() != KEYWORD.lower().encode():
            return None  # not ours: the session authenticator may answer
        if len(parts) != 2:
            raise AuthenticationFailed("Invalid token header.")
        try:
            key = parts[1].decode("ascii")
        except UnicodeError:
            raise AuthenticationFailed("Invalid token.") from None
        now = timezone.now()
        token = AgentToken.objects.authenticate(key, now)
        if token is None:
            raise AuthenticationFailed("Invalid token.")
        token.touch(now)
        logs.bind_tenant(token.tenant_id)
        return token.user, token

    def authenticate_header(self, request: Request) -> str:
        return KEYWORD


class AgentTokenScheme(OpenApiAuthenticationExtension):
    """The OpenAPI security scheme: the same `tokenAuth` DRF's token scheme was."""

    target_class = "runtime.auth.AgentTokenAuthentication"
    name = "tokenAuth"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {
            "type": "apiKey",
            "in": "header",
            "name": "Authorization",
            "description": 'Agent token with the prefix "Token", e.g. "Token hpt_…"',
        }


@dataclass(frozen=True)
class Issued:
    """A new token and its key. The key exists only here: show it once, store it nowhere."""

    token: AgentToken
    key: str


def token_tenant(user: User, tenant: Tenant | None = None) -> Tenant:
    """The tenant a new token of `user` acts in: the agent account's one tenant. ValueError
    for a person: API tokens are for agent accounts only (issue 15, part 5) — a reviewer
    decides on the pages, where the session, CSRF and the separation of duties apply, never
    with a key a script can hold."""
    memberships = Membership.objects.filter(user=user).select_related("tenant")
    if tenant is not None:
        memberships = memberships.filter(tenant=tenant)
    found = list(memberships[:2])
    if not found:
        raise ValueError(f"{user.get_username()} is not a member of that tenant")
    if any(m.role != Role.AGENT for m in found):
        raise ValueError(
            f"{user.get_username()} is a person, not an agent account: "
            "API tokens are for agent accounts only"
        )
    return found[0].tenant


def _describe(token: AgentToken) -> dict[str, Any]:
    return {
        "agent": token.user.get_username(),
        "token_prefix": token.prefix,
        "name": token.name,
        "expires_at": token.expires_at.isoformat() if token.expires_at else None,
    }


def _create(
    user: User, tenant: Tenant, actor: str, name: str, expires_at: datetime | None
) -> Issued:
    key = new_key()
    token = AgentToken.objects.create(
        tenant=tenant,
        user=user,
        name=name,
        prefix=key[:PREFIX_LENGTH],
        key_hash=hash_key(key),
        created_by=actor,
        expires_at=expires_at,
    )
    return Issued(token, key)


def issue_token(
    user: User,
    *,
    actor: str,
    tenant: Tenant | None = None,
    name: str = "",
    expires_at: datetime | None = None,
) -> Issued:
    """A new token for `user` in their (or the given) tenant; recorded as token_created."""
    tenant = token_tenant(user, tenant)
    with transaction.atomic():
        issued = _create(user, tenant, actor, name, expires_at)
        record_tenant_act(tenant.pk, "token_created", actor, **_describe(issued.token))
    return issued


def rotate_tokens(
    user: User,
    *,
    actor: str,
    overlap: timedelta = DEFAULT_OVERLAP,
    tenant: Tenant | None = None,
    replace: list[AgentToken] | None = None,
    name: str | None = None,
) -> tuple[Issued, list[AgentToken]]:
    """Issue a new token and let the old ones (`replace`, default: every live token of the
    user in that tenant) expire `overlap` from now — both work until then, only the new one
    after. An old token already expiring sooner keeps its earlier time."""
    tenant = token_tenant(user, tenant)
    now = timezone.now()
    until = now + overlap
    with transaction.atomic():
        if replace is None:
            old = list(AgentToken.objects.filter(user=user, tenant=tenant).select_for_update())
        else:
            pks = [t.pk for t in replace]
            old = list(
                AgentToken.objects.filter(pk__in=pks, user=user, tenant=tenant).select_for_update()
            )
        old = [t for t in old if t.is_live(now)]
        for token in old:
            if token.expires_at is None or token.expires_at > until:
                token.expires_at = until
                token.save(update_fields=["expires_at"])
        label = name if name is not None else (old[0].name if old else "")
        issued = _create(user, tenant, actor, label, None)
        record_tenant_act(
            tenant.pk,
            "token_rotated",
            actor,
            **_describe(issued.token),
            replaced=[
                {
                    "token_prefix": t.prefix,
                    # Set by the loop above; `None` only to satisfy the type of the field.
                    "expires_at": t.expires_at.isoformat() if t.expires_at else None,
                }
                for t in old
            ],
        )
    return issued, old


def revoke_token(token: AgentToken, *, actor: str) -> bool:
    """Refuse the token from now on; False if it was already revoked (nothing recorded)."""
    now = timezone.now()
    with transaction.atomic():
        changed = AgentToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(
            revoked_at=now
        )
        if changed:
            token.revoked_at = now
            record_tenant_act(token.tenant_id, "token_revoked", actor, **_describe(token))
    return bool(changed)


_DURATION = re.compile(r"^\s*(\d+)\s*([smhd]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> timedelta:
    """'24h', '30m', '90s', '7d' or plain seconds; ValueError otherwise."""
    match = _DURATION.match(text.lower())
    if match is None:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90s, 30m, 24h, 7d)")
    return timedelta(seconds=int(match.group(1)) * _UNITS[match.group(2)])


# --- open streams ------------------------------------------------------------------------


@dataclass(frozen=True)
class Standing:
    """What an open live-event stream was authenticated as, to be asked again while it lives.

    Every API call authenticates afresh, so a revoked token or a logged-out session is
    refused at its next request; a stream is one request that lasts for hours. It keeps this
    (never the token's key) and `runtime.api.streams.Recheck` asks `holds()` again at least
    once per keep-alive interval; when it no longer holds, the stream ends, and the client's
    reconnect is refused like any other call. The principal must stay the one the stream
    was opened as — same user, tenant and role — or the stream ends and the reconnect is
    scoped afresh."""

    user_id: int
    tenant_id: int
    role: str
    token_id: int | None = None  # opened with an agent token
    session_key: str | None = None  # opened with a browser session

    @classmethod
    def of(cls, request: Request, principal: Principal) -> Standing:
        token = request.auth if isinstance(request.auth, AgentToken) else None
        return cls(
            user_id=principal.user.pk,
            tenant_id=principal.tenant.pk,
            role=principal.role,
            token_id=token.pk if token is not None else None,
            session_key=None if token is not None else request.session.session_key,
        )

    def holds(self, now: datetime | None = None) -> bool:
        """Whether the same request would still be let in as the same principal: the token
        usable (not revoked, not expired, its user active and still the tenant's agent), or
        the session alive (not logged out, not expired, its absolute age under
        HOLDPOINT_SESSION_MAX_AGE, its user active and their password unchanged) and its user
        still a member of the tenant in the same role."""
        now = now or timezone.now()
        if self.token_id is not None:
            return AgentToken.objects.usable(now).filter(pk=self.token_id).exists()
        user = self._session_user(now)
        if user is None or user.pk != self.user_id:
            return False
        principal = principal_for(user, self.tenant_id)
        return (
            principal is not None
            and principal.tenant.pk == self.tenant_id
            and principal.role == self.role
        )

    def _session_user(self, now: datetime) -> Any:
        """The session's user as `django.contrib.auth.get_user` finds it (the session's
        password hash checked, an inactive user refused), or None."""
        from importlib import import_module

        from django.conf import settings
        from django.contrib.auth import get_user
        from django.http import HttpRequest

        if not self.session_key:
            return None
        # Loading a session that was deleted (logout) or expired yields an empty one.
        session = import_module(settings.SESSION_ENGINE).SessionStore(self.session_key)
        if outlived(session, now.timestamp()):
            return None
        request = HttpRequest()
        request.session = session
        user = get_user(request)
        return user if user.is_authenticated else None
