"""/api/v1/ — the agent-facing contract (API.md); the approvals routes are the approvals
app's own (`approvals.api_urls`, mounted beside these by `config.urls`)."""

from csp.decorators import csp_update
from django.urls import path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView

from runtime.api import toolviews, views

urlpatterns = [
    path("runs/", views.RunList.as_view(), name="api-runs"),
    path("runs/<uuid:run_id>/", views.RunDetail.as_view(), name="api-run"),
    path("runs/<uuid:run_id>/revisions/", views.Revisions.as_view(), name="api-revisions"),
    path("runs/<uuid:run_id>/input/", views.Input.as_view(), name="api-input"),
    path("runs/<uuid:run_id>/cancel/", views.Cancel.as_view(), name="api-cancel"),
    path("runs/<uuid:run_id>/resume/", views.Resume.as_view(), name="api-resume"),
    path("runs/<uuid:run_id>/checkpoints/", views.Checkpoints.as_view(), name="api-checkpoints"),
    path(
        "runs/<uuid:run_id>/checkpoints/<int:rev>/",
        views.CheckpointDetail.as_view(),
        name="api-checkpoint",
    ),
    path("runs/<uuid:run_id>/events/", views.Events.as_view(), name="api-events"),
    path("runs/<uuid:run_id>/actions/", views.RunActions.as_view(), name="api-run-actions"),
    path("runs/<uuid:run_id>/lease/", views.Lease.as_view(), name="api-lease"),
    path("runs/<uuid:run_id>/lease/heartbeat/", views.Heartbeat.as_view(), name="api-heartbeat"),
    path("runs/<uuid:run_id>/lease/release/", views.Release.as_view(), name="api-release"),
    path("actions/", views.Actions.as_view(), name="api-actions"),
    path("actions/<uuid:action_id>/", views.ActionDetail.as_view(), name="api-action"),
    path("actions/<uuid:action_id>/dispatch/", views.Dispatch.as_view(), name="api-dispatch"),
    path("actions/<uuid:action_id>/outcome/", views.Outcome.as_view(), name="api-outcome"),
    path("actions/<uuid:action_id>/resolve/", views.Resolve.as_view(), name="api-resolve"),
    path("tools/", toolviews.ToolList.as_view(), name="api-tools"),
    path("tools/<str:name>/", toolviews.ToolDetail.as_view(), name="api-tool"),
    path("schema/", SpectacularAPIView.as_view(), name="api-schema"),
    # The split view serves its init script as a file (strict CSP); Swagger UI's stylesheet
    # draws its icons from data: URLs, so this page alone allows data: images.
    path(
        "docs/",
        csp_update({"img-src": ["data:"]})(
            # GET only: OPTIONS would render DRF's metadata with the page's HTML renderer (500).
            SpectacularSwaggerSplitView.as_view(
                url_name="api-schema",
                template_name="api/swagger_ui.html",
                http_method_names=["get", "head"],
            )
        ),
        name="api-docs",
    ),
]
