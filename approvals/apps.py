from django.apps import AppConfig


class ApprovalsConfig(AppConfig):
    name = "approvals"
    verbose_name = "Approvals"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from approvals.holdpoints import HoldPoints
        from approvals.metrics import PendingApprovals
        from runtime import gates, metrics

        gates.install(HoldPoints())
        metrics.add_collector(PendingApprovals())
