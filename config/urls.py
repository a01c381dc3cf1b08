"""URL map: reviewer pages, Django admin, probes, and the agent API under /api/v1/."""

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from django.views.generic import RedirectView

from approvals import views as approval_views
from runtime import health, metrics
from runtime.accounts import ReviewerLoginForm
from runtime.pages import audit as audit_pages
from runtime.pages import reconcile as reconcile_pages
from runtime.pages import runs as pages
from runtime.pages import tenant

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="inbox", permanent=False)),
    path(
        "login/",
        auth_views.LoginView.as_view(authentication_form=ReviewerLoginForm),
        name="login",
    ),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path(
        "password/",
        auth_views.PasswordChangeView.as_view(template_name="registration/change_password.html"),
        name="password_change",
    ),
    path(
        "password/done/",
        auth_views.PasswordChangeDoneView.as_view(
            template_name="registration/change_password_done.html"
        ),
        name="password_change_done",
    ),
    path("inbox/", approval_views.inbox, name="inbox"),
    path("inbox/list/", approval_views.inbox_list, name="inbox-list"),
    path("inbox/history/", approval_views.history, name="inbox-history"),
    path("overview/", approval_views.overview, name="overview"),
    path("approvals/<uuid:request_id>/", approval_views.request_page, name="approval-page"),
    path(
        "approvals/<uuid:request_id>/status/",
        approval_views.request_status,
        name="approval-page-status",
    ),
    path(
        "approvals/<uuid:request_id>/decide/",
        approval_views.decide_page,
        name="approval-page-decide",
    ),
    path(
        "approvals/for-action/<uuid:action_id>/",
        approval_views.request_for_action,
        name="approval-for-action",
    ),
    path("tenant/switch/", tenant.switch_tenant_view, name="switch-tenant"),
    path("runs/", pages.runs_page, name="runs"),
    path("runs/<uuid:run_id>/", pages.run_page, name="run"),
    path("runs/<uuid:run_id>/live/", pages.run_live, name="run-live"),
    path("runs/<uuid:run_id>/cancel/", pages.run_cancel, name="run-cancel"),
    path("runs/<uuid:run_id>/resume/", pages.run_resume, name="run-resume"),
    path("runs/<uuid:run_id>/input/", pages.run_input, name="run-input"),
    path("runs/<uuid:run_id>/revise/", pages.run_revise, name="run-revise"),
    path("runs/<uuid:run_id>/executor/", pages.run_executor, name="run-executor"),
    path(
        "actions/<uuid:action_id>/compensate/",
        pages.action_compensate,
        name="action-compensate",
    ),
    path(
        "actions/<uuid:action_id>/send-again/",
        pages.action_send_again,
        name="action-send-again",
    ),
    path("runs/<uuid:run_id>/trail/", audit_pages.run_trail, name="run-trail"),
    path("reconcile/", reconcile_pages.reconcile_list, name="reconcile"),
    path(
        "reconcile/<uuid:action_id>/",
        reconcile_pages.reconcile_detail,
        name="reconcile-detail",
    ),
    path(
        "reconcile/<uuid:action_id>/resolve/",
        reconcile_pages.reconcile_resolve,
        name="reconcile-resolve",
    ),
    path("audit/", audit_pages.audit_log, name="audit-log"),
    path("audit/export.csv", audit_pages.export_csv, name="audit-export-csv"),
    path("audit/export.jsonl", audit_pages.export_jsonl, name="audit-export-jsonl"),
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("metrics", metrics.metrics, name="metrics"),
    path("admin/", admin.site.urls),
    path("api/v1/", include("runtime.api.urls")),
    path("api/v1/", include("approvals.api_urls")),
]

handler403 = "runtime.api.problems.permission_denied"
handler404 = "runtime.api.problems.not_found"
handler500 = "runtime.api.problems.server_error"
