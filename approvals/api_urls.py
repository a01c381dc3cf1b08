"""The approvals app's part of /api/v1/ (API.md, "Approvals"), mounted by `config.urls`.

The app owns its routes, so the runtime's API never imports approvals (DESIGN.md layering).
"""

from django.urls import path

from approvals import api

urlpatterns = [
    path("approvals/", api.Approvals.as_view(), name="api-approvals"),
    path("approvals/<uuid:approval_id>/", api.ApprovalDetail.as_view(), name="api-approval"),
    path(
        "approvals/<uuid:approval_id>/decision/",
        api.Decision.as_view(),
        name="api-decision",
    ),
]
