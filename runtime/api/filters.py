"""List filters (API.md "Lists: filters as query params") as django-filter FilterSets.

A FilterSet validates through a Django form, so a status word that does not exist and a NUL
character (PostgreSQL text cannot hold one; forms.CharField refuses it) are both a 422
`invalid_params` with field errors, the same on SQLite and PostgreSQL, before any query runs.
The OpenAPI parameters are derived from the same FilterSets, so schema and code cannot drift.
"""

from __future__ import annotations

from typing import Any

import django_filters
from django.db.models import QuerySet
from django.http import QueryDict
from drf_spectacular.utils import OpenApiParameter
from rest_framework.request import Request

from runtime.errors import InvalidParams
from runtime.models import Action, ActionStatus, Run, RunStatus


class RunFilter(django_filters.FilterSet):
    status = django_filters.ChoiceFilter(choices=RunStatus.choices)
    thread_id = django_filters.CharFilter(max_length=200)
    graph = django_filters.CharFilter(max_length=100)

    class Meta:
        model = Run
        fields = ["status", "thread_id", "graph"]


class ActionFilter(django_filters.FilterSet):
    status = django_filters.ChoiceFilter(choices=ActionStatus.choices)
    tool = django_filters.CharFilter(max_length=100)
    idempotency_key = django_filters.CharFilter(max_length=255)

    class Meta:
        model = Action
        fields = ["idempotency_key", "status", "tool"]


def apply(
    filterset: type[django_filters.FilterSet], request: Request, queryset: QuerySet[Any]
) -> QuerySet[Any]:
    """The queryset narrowed by the request's filters; invalid filters are a 422."""
    return narrowed(filterset, request.query_params, queryset, request=request)


def narrowed(
    filterset: type[django_filters.FilterSet],
    params: QueryDict,
    queryset: QuerySet[Any],
    *,
    request: Any = None,
    empty_choice_is_error: bool = True,
) -> QuerySet[Any]:
    """The queryset narrowed by `params`, or InvalidParams naming each bad filter.

    The API and the reviewer pages both filter through here, so a value one refuses the
    other refuses too (issue 16, L1). A page's filter form sends `status=` for "any", which
    `empty_choice_is_error=False` allows; an API client leaves the parameter out.
    """
    bound = filterset(params, queryset=queryset, request=request)
    errors: dict[str, list[str]] = {}
    if not bound.is_valid():
        errors = {name: [str(m) for m in messages] for name, messages in bound.errors.items()}
    for name, field in filterset.base_filters.items():
        # django-filter reads an empty value as "no filter"; for a status word that is a
        # typo the caller should hear about (the schema's enum has no "").
        empty = params.get(name) == ""
        if isinstance(field, django_filters.ChoiceFilter) and empty and empty_choice_is_error:
            errors.setdefault(name, []).append("empty; leave the parameter out to list all")
    if errors:
        names = ", ".join(sorted(errors))
        raise InvalidParams(f"invalid list filter: {names}", errors=errors)
    return bound.qs


def parameters(filterset: type[django_filters.FilterSet] | None) -> list[OpenApiParameter]:
    """OpenAPI query parameters for a FilterSet's filters (enums for choices) and the cursor."""
    params = []
    for name, field in filterset.base_filters.items() if filterset else []:
        choices = field.extra.get("choices")
        params.append(
            OpenApiParameter(
                name,
                str,
                description=f"only objects whose {name} equals this",
                enum=[value for value, _ in choices] if choices else None,
            )
        )
    params.append(OpenApiParameter("cursor", str, description="page cursor"))
    return params
