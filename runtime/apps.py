from django.apps import AppConfig


class RuntimeConfig(AppConfig):
    name = "runtime"
    verbose_name = "Runtime"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.conf import settings

        from runtime import checks  # noqa: F401  (registers system checks)
        from runtime.graphs import load_graph_modules

        load_graph_modules(settings.HOLDPOINT_GRAPH_MODULES)
        from runtime import accounts

        accounts.connect()
