"""Holdpoint as an MCP gateway (issue 19; README, "MCP gateway").

A tenant's MCP endpoint, `/mcp/<tenant-slug>/`: an MCP client (an agent host) lists the
tenant's tools and calls them through Holdpoint, and every call gets the ledger's
guarantees — a durable action in the session's run, held when a policy says so, sent once,
recorded, handed to a person when its outcome is lost.

Above both apps (it imports `runtime` and `approvals`; neither imports it):
- `gateway.calls`: the synchronous core — who calls, the session's run, one call from its
  arguments to an answer — through the executor protocol (runtime.protocol) and the
  dispatch path every external run uses; no MCP SDK here.
- `gateway.server`: the MCP side — the SDK's server in stateless mode behind Holdpoint's own
  authentication and durable session ids, and the waiting. Imported only by
  `config.asgi`'s mount builder: the SDK costs 0.6 s to import, which workers and commands
  never pay.
"""
