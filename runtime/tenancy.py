"""Who is asking, in which tenant, and the one place tenant scoping happens.

Every query of tenant data goes through a `*_for(principal)` helper here (or in the module of
the concept, built on `scope()`), so isolation is enforced in one place: another tenant's
object is simply not in the queryset, hence 404 — never 403, which would confirm it exists.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from django.contrib.auth.models import AnonymousUser, User
from django.core.exceptions import ObjectDoesNotExist, ValidationError
from django.db.models import Model, QuerySet
from django.http import HttpRequest, HttpResponse

from runtime import logs
from runtime.errors import NotFound
from runtime.models import Membership, Role, Tenant

if TYPE_CHECKING:
    from audit.models import JournalEntry
    from runtime.models import Action, Checkpoint, Run

M = TypeVar("M", bound=Model)
security_log = logging.getLogger("holdpoint.security")
SESSION_KEY = "holdpoint_tenant_id"


@dataclass(frozen=True)
class Principal:
    """A user or agent account acting in one tenant with one role."""

    user: User
    tenant: Tenant
    role: str
    # Every active tenant the user belongs to, read with the membership that chose `tenant`
    # (the pages' tenant switcher): a page then reads the memberships once, not twice.
    tenants: tuple[Tenant, ...] = field(default=(), compare=False, repr=False)

    @property
    def is_agent(self) -> bool:
        return self.role == Role.AGENT

    @property
    def may_act(self) -> bool:
        """May pull a run's levers (start, cancel, resume, input, revise) from the pages.

        Viewers only look; agents act through the API with their token.
        """
        return self.role in (Role.ADMIN, Role.REVIEWER)

    @property
    def label(self) -> str:
        kind = "agent" if self.is_agent else "user"
        return f"{kind}:{self.user.get_username()}"


def memberships_of(user: User | AnonymousUser) -> QuerySet[Membership]:
    """Active-tenant memberships of a user; inactive tenants are invisible to everyone."""
    if not user.is_authenticated or not user.is_active:
        return Membership.objects.none()
    return Membership.objects.filter(user=user, tenant__active=True).select_related("tenant")


def tenants_for(user: User) -> QuerySet[Tenant]:
    return Tenant.objects.filter(active=True, memberships__user=user).distinct()


def principal_for(user: User | AnonymousUser, tenant_id: int | None = None) -> Principal | None:
    """The principal a user acts as: the chosen tenant if a member, else the first one."""
    memberships = list(memberships_of(user))
    if not memberships:
        return None
    chosen = next((m for m in memberships if m.tenant_id == tenant_id), memberships[0])
    # The user asked about, not `chosen.user`: that is the same row read a second time.
    assert isinstance(user, User)
    tenants = tuple(m.tenant for m in memberships)
    return Principal(user=user, tenant=chosen.tenant, role=chosen.role, tenants=tenants)


def scope(queryset: QuerySet[M], principal: Principal) -> QuerySet[M]:
    """Restrict a queryset of a tenant-owned model to the principal's tenant."""
    return queryset.filter(tenant=principal.tenant)


def get_scoped(queryset: QuerySet[M], principal: Principal, **lookup: Any) -> M:
    """One object of the principal's tenant, or NotFound (also for other tenants' objects)."""
    try:
        return scope(queryset, principal).get(**lookup)
    except (ObjectDoesNotExist, ValueError, TypeError, ValidationError):
        # A malformed id is answered like a missing one: no oracle for what ids look like.
        _log_if_foreign(queryset, principal, lookup)
        raise NotFound() from None


def _log_if_foreign(queryset: QuerySet[Any], principal: Principal, lookup: dict[str, Any]) -> None:
    """Another tenant's id is worth an operator's attention (ASVS 16.3.2: log denied access).
    Only the server log hears of it; the caller got the same 404 as for a missing id, and the
    lookup runs for every miss, so its cost says nothing either."""
    try:
        foreign = (
            queryset.model._base_manager.filter(**lookup).exclude(tenant=principal.tenant).exists()
        )
    except (ValueError, TypeError, ValidationError):
        return
    if foreign:
        security_log.warning(
            "cross-tenant access refused: %s %s by %s in tenant %s",
            queryset.model._meta.label,
            ",".join(f"{k}={v}" for k, v in sorted(lookup.items())),
            principal.label,
            principal.tenant.slug,
        )


def memberships_for(principal: Principal) -> QuerySet[Membership]:
    return scope(Membership.objects.select_related("user", "tenant"), principal)


def switch_tenant(request: HttpRequest, tenant_id: int) -> Principal:
    """Make another of the user's tenants the current one; NotFound if not a member."""
    principal = principal_for(request.user, tenant_id)
    if principal is None or principal.tenant.pk != tenant_id:
        raise NotFound()
    request.session[SESSION_KEY] = tenant_id
    return principal


class CurrentTenantMiddleware:
    """Attaches `request.principal` for session users (API auth resolves its own)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        request.principal = principal = principal_for(  # type: ignore[attr-defined]
            request.user, request.session.get(SESSION_KEY)
        )
        if principal is not None:
            logs.bind_tenant(principal.tenant.pk)
        return self.get_response(request)


def tenant_context(request: HttpRequest) -> dict[str, Any]:
    principal = getattr(request, "principal", None)
    if principal is None:
        return {"principal": None, "tenant_choices": []}
    return {
        "principal": principal,
        "tenant_choices": list(principal.tenants),
    }


def runs_for(principal: Principal) -> QuerySet[Run]:
    """The principal's tenant's runs — every run query of a page or API goes through here."""
    from runtime.models import Run

    return scope(Run.objects.all(), principal)


def checkpoints_for(principal: Principal) -> QuerySet[Checkpoint]:
    from runtime.models import Checkpoint

    return scope(Checkpoint.objects.all(), principal)


def actions_for(principal: Principal) -> QuerySet[Action]:
    from runtime.models import Action

    return scope(Action.objects.all(), principal)


def journal_for(principal: Principal) -> QuerySet[JournalEntry]:
    """Journal entries of the principal's tenant (the audit app knows tenants by id only)."""
    from audit.models import JournalEntry

    return JournalEntry.objects.filter(tenant_id=principal.tenant.pk)


def slug_of(tenant_id: int) -> str:
    """A tenant's slug by its id, read once per tenant and process (a tenant's slug does not
    change): what traces name a tenant by (runtime.tracing.tenant_slug)."""
    slug = _slugs.get(tenant_id)
    if slug is None:
        slug = Tenant.objects.filter(pk=tenant_id).values_list("slug", flat=True).first() or ""
        if len(_slugs) >= 10_000:
            _slugs.clear()
        _slugs[tenant_id] = slug
    return slug


_slugs: dict[int, str] = {}
