"""The `mcp-session` graph: the run behind each session of the MCP gateway (gateway/).

A session's run is external: the gateway is its executor (through runtime.protocol, like
any agent running its own loop), each `tools/call` one action of the step `api`. No worker
ever executes it, so its one step only says so if something tried. Registered by the
runtime app at start-up in every process (not through HOLDPOINT_GRAPH_MODULES): the pages,
the sweeper and the API must know the graph of any run they show.
"""

from __future__ import annotations

from runtime.context import StepContext
from runtime.graphs import Fail, Graph, Outcome, register

NAME = "mcp-session"

graph = Graph(
    NAME,
    version="1",
    description=(
        "A session of an MCP client with Holdpoint's gateway (/mcp/<tenant>/): each "
        "tools/call is one action of this run."
    ),
)


@graph.step(start=True)
def api(ctx: StepContext) -> Outcome:
    return Fail("an mcp-session run is executed by the MCP gateway, not by a worker")


register(graph)
