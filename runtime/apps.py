from collections.abc import Mapping
from typing import Any

from django.apps import AppConfig


def _build_mcp_tool(spec: Mapping[str, Any], fields: dict[str, Any]) -> Any:
    from runtime import mcp

    return mcp.build(spec, fields)


class RuntimeConfig(AppConfig):
    name = "runtime"
    verbose_name = "Runtime"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.conf import settings

        from runtime import (
            admin_tools,  # noqa: F401  (tool definitions' and MCP servers' admin)
            checks,  # noqa: F401  (registers system checks)
        )
        from runtime.tools import Sender, register_sender

        # `mcp` tools are built by runtime.mcp, imported only when one is: the MCP SDK
        # costs every process about 0.6 s to import (workers, commands, tests).
        register_sender(Sender.MCP, _build_mcp_tool)
        from runtime.graphs import load_graph_modules

        load_graph_modules(settings.HOLDPOINT_GRAPH_MODULES)
        from runtime import accounts
        from runtime.agents import mcp_session  # noqa: F401  (the MCP gateway's runs)

        accounts.connect()
        from django_q.signals import post_spawn

        from runtime.sweeper import start_in_worker

        # Each django-q2 worker process runs a sweeper loop; they take turns (SweeperTurn).
        post_spawn.connect(start_in_worker, dispatch_uid="holdpoint-sweeper-thread")
        from django.db.models.signals import post_migrate, pre_migrate

        from runtime import sqlitestep, tenancy, tracing

        # SQLite's one-statement step commit: its view and trigger are made from the models
        # after every migrate and dropped before it (runtime.sqlitestep says why).
        pre_migrate.connect(
            sqlitestep.dropped_before_migrate, sender=self, dispatch_uid="holdpoint-step-view-"
        )
        post_migrate.connect(
            sqlitestep.made_after_migrate, sender=self, dispatch_uid="holdpoint-step-view+"
        )
        tracing.name_tenants(tenancy.slug_of)
        tracing.configure()  # on only when OTEL_TRACES_EXPORTER names an exporter
