"""The journal in Django admin: read-only, tenant-scoped, and cheap on millions of entries.

Nobody adds, changes or deletes history here (DESIGN.md, invariant 8): no add, change or
delete permission, no actions. A tenant admin sees only the entries of the tenants they
administer (invariant 9); operators (superusers) see all. `runtime.admin` is imported inside
the methods, so `audit` keeps no module-level dependency on `runtime` (DESIGN.md, layering).

On millions of rows the changelist avoids what would scan or sort the table: no
full-result COUNT, a count capped for the paginator, a type filter with fixed choices
instead of SELECT DISTINCT, exact (indexable) search instead of a substring LIKE, and no
sorting by a clicked column.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.core.paginator import Paginator
from django.db.models import Q, QuerySet
from django.http import HttpRequest
from django.utils.functional import cached_property

from audit.models import JournalEntry

# Paging past this many entries in admin is not what it is for: the audit log page pages
# through everything by keyset; here the count stops at this, and so does OFFSET.
COUNT_CAP = 10_000


class CappedCountPaginator(Paginator):
    """Counts at most COUNT_CAP rows: `SELECT COUNT(*) FROM (… LIMIT cap)` stays cheap."""

    @cached_property
    def count(self) -> int:
        return self.object_list[:COUNT_CAP].count()  # type: ignore[no-any-return]


class NewestFirst(ChangeList):
    """Always newest first: sorting millions of rows by a clicked column (`?o=`) would be a
    full sort; id order is what the indexes hold."""

    def get_ordering(self, request: HttpRequest, queryset: QuerySet[Any]) -> list[str]:
        return ["-id"]


class TypeFilter(admin.SimpleListFilter):
    """Event types from the code's list, not SELECT DISTINCT type over the whole journal."""

    title = "type"
    parameter_name = "type"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        from runtime.audit_pages import KNOWN_TYPES

        return [(name, name) for name in KNOWN_TYPES]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(type=value) if value else queryset


@admin.register(JournalEntry)
class JournalEntryAdmin(admin.ModelAdmin):
    list_display = ["stream", "seq", "type", "actor", "created_at"]
    list_filter = [TypeFilter]
    search_fields = ["stream", "actor"]
    search_help_text = "Exact stream (run:<run id>, tenant:<id>) or exact actor (user:alice)."
    ordering = ["-id"]
    sortable_by: list[str] = []  # no sort links on the column headers (see NewestFirst)
    actions = None
    show_full_result_count = False
    paginator = CappedCountPaginator

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return NewestFirst

    def get_queryset(self, request: HttpRequest) -> QuerySet[JournalEntry]:
        qs = super().get_queryset(request)
        if request.user.is_superuser:
            return qs
        from runtime.admin import admin_tenants

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

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [field.name for field in self.model._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
