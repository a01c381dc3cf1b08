"""An MCP client calling a tool through Holdpoint's gateway — what an agent host does.

    HOLDPOINT_TOKEN=<agent token> python examples/mcp_gateway_client.py \\
        http://127.0.0.1:8000/mcp/demo/ tasks.create '{"title": "Rotate the API key"}'

Lists the tenant's tools (each description says whether a call waits for a reviewer), then
calls one with the `mcp` SDK's ClientSession over streamable HTTP, asking for progress
notifications: a call held for approval waits (up to HOLDPOINT_MCP_WAIT_SECONDS, printing
each notification) and prints the upstream's answer once a reviewer approved — or `PENDING:`
with the request's link when the wait ran out; run it again with the same arguments and
`--session <id>` (printed before the result) to get the decided outcome. Exit 0 on a result,
1 on an error result (a rejection, a call that needs a person).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

import httpx2
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client


async def main(url: str, token: str, tool: str, arguments: dict[str, Any], session: str) -> int:
    headers = {"Authorization": f"Bearer {token}"}
    if session:
        headers["Mcp-Session-Id"] = session  # carry on a session (the run) after a reconnect
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(None)) as http:
        async with streamable_http_client(url, http_client=http) as (read, write):
            async with ClientSession(read, write) as client:
                await client.initialize()
                for listed in (await client.list_tools()).tools:
                    print(f"tool {listed.name}: {listed.description}")

                async def progress(done: float, total: float | None, message: str | None) -> None:
                    print(f"progress {done:.0f}/{total or 0:.0f}s: {message}")

                result = await client.call_tool(tool, arguments, progress_callback=progress)
    print(f"session {(result.meta or {}).get('holdpoint/session', '')}")
    texts = [getattr(block, "text", "") for block in result.content]
    if result.structured_content is not None:
        print("result", json.dumps(result.structured_content, sort_keys=True))
    else:
        print("result", " ".join(texts))
    return 1 if result.is_error else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="the tenant's endpoint, e.g. http://127.0.0.1:8000/mcp/demo/")
    parser.add_argument("tool")
    parser.add_argument("arguments", nargs="?", default="{}", help="the call's JSON arguments")
    parser.add_argument("--session", default="", help="carry on this session (its run id)")
    args = parser.parse_args()
    token = os.environ.get("HOLDPOINT_TOKEN", "")
    if not token:
        sys.exit("HOLDPOINT_TOKEN must hold an agent token (manage.py agent_token issue …)")
    sys.exit(
        asyncio.run(main(args.url, token, args.tool, json.loads(args.arguments), args.session))
    )
