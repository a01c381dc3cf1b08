"""The one place approval requests are scoped to a tenant.

Every query of approval requests made for a principal — the inbox, the history, one request,
the next item to triage, the similar past decisions — starts from `approvals_for`, so
another tenant's request is simply not in the queryset: a 404 exactly like an id that does
not exist, never a 403 that would confirm it exists (DESIGN.md, invariant 9).
"""

from __future__ import annotations

from django.db.models import QuerySet

from approvals.models import ApprovalRequest
from runtime.tenancy import Principal, scope


def approvals_for(principal: Principal) -> QuerySet[ApprovalRequest]:
    """The principal's tenant's approval requests (any status)."""
    return scope(ApprovalRequest.objects.all(), principal)
