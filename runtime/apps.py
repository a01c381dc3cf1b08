from django.apps import AppConfig


class RuntimeConfig(AppConfig):
    name = "runtime"
    verbose_name = "Runtime"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.conf import settings

        from runtime import (
            admin_tools,  # noqa: F401  (tool definitions' and MCP servers' admin)
            checks,  # noqa: F401  (registers system checks)
            mcp,  # noqa: F401  (registers the builder of `mcp` tools)
        )
        from runtime.graphs import load_graph_modules

        load_graph_modules(settings.HOLDPOINT_GRAPH_MODULES)
        from runtime import accounts

        accounts.connect()
        from django_q.signals import post_spawn

        from runtime.sweeper import start_in_worker

        # Each django-q2 worker process runs a sweeper loop; they take turns (SweeperTurn).
        post_spawn.connect(start_in_worker, dispatch_uid="holdpoint-sweeper-thread")
