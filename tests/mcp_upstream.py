"""A test MCP upstream: a help desk served with the `mcp` SDK over streamable HTTP (or stdio),
run as a real process by the tests (`python -m tests.mcp_upstream --port P --data DIR`).

The oracle is its own record, not Holdpoint's: every call that reaches a tool appends one
JSON line to DIR/calls.jsonl *before* the tool answers, so a test can count effects across a
lost answer. DIR/faults.json, read on each call, makes the next answers misbehave:
`{"hang": SECONDS}` applies the call (it is recorded) and then waits before answering — a
client with a shorter timeout never learns the outcome; `{"huge": BYTES}` applies it and
answers with that much padding; `{"id": VALUE}` applies it and answers with VALUE (any JSON:
true, "", an object) where the ticket's id belongs; `{"delay": SECONDS}` waits *before* it
applies the call — a request still in flight, whose effect a lookup cannot find yet;
`{"raw": TEXT}` answers with the JSON text TEXT, byte for byte, as the ticket's `note` (and
in its text block), over either transport: what the SDK's own encoder never writes — NaN,
Infinity, a lone surrogate escape — or what PostgreSQL's JSON refuses (`\u0000`).
A ticket titled "quote my token" is refused with an error that quotes the request's
Authorization header (as written and JSON-escaped); one titled "echo my token" is opened and
its answer echoes that header (`seen`), as `{"echo_token": true}` makes the finder's do.
`{"legacy": true}` makes it a server of the 2025 protocol (sessions),
`{"hold_initialized": SECONDS}` then holds a session's `notifications/initialized` that long
(Legacy).

With `--keyed` it also serves a help desk that stores a client's request id with each ticket
and finds a ticket by it (`tickets_open`, `tickets_find`; `tickets_find_text` answers in plain
text): what an MCP definition with dedup `lookup` needs. `{"find_fails": 1}` makes the finder
answer with an error. Each call of a finder is appended to DIR/finds.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
from pathlib import Path
from typing import Any, BinaryIO

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations

DATA = Path(".")
server = MCPServer("helpdesk")


def _record(tool: str, arguments: dict[str, Any]) -> int:
    """Append the call; its number (1-based) is the ticket's."""
    path = DATA / "calls.jsonl"
    with path.open("a", encoding="utf-8") as out:
        out.write(json.dumps({"tool": tool, "arguments": arguments}) + "\n")
    return len(path.read_text(encoding="utf-8").splitlines())


def _faults() -> dict[str, Any]:
    path = DATA / "faults.json"
    faults: dict[str, Any] = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    return faults


async def _misbehave() -> None:
    faults = _faults()
    if faults.get("hang"):
        await asyncio.sleep(float(faults["hang"]))


# The calls being applied later (`delay`): kept, so a client that gave up does not stop them.
_LATER: set[asyncio.Task[int]] = set()


async def _applied(tool: str, arguments: dict[str, Any]) -> int:
    """Record the call — with `{"delay": SECONDS}` only that much later, and then even if
    the client has given up meanwhile (as a service that has the request applies it)."""
    seconds = float(_faults().get("delay") or 0)
    if not seconds:
        return _record(tool, arguments)

    async def later() -> int:
        await asyncio.sleep(seconds)
        return _record(tool, arguments)

    task = asyncio.ensure_future(later())
    _LATER.add(task)
    task.add_done_callback(_LATER.discard)
    return await asyncio.shield(task)


def _found_by(tool: str, request_id: str) -> None:
    with (DATA / "finds.jsonl").open("a", encoding="utf-8") as out:
        out.write(json.dumps({"tool": tool, "request_id": request_id}) + "\n")


# Stands for the `raw` fault's text in an answer; the Raw middleware puts the text there.
RAW = "@@raw@@"


def _ticket(number: int, title: str) -> dict[str, Any]:
    """The answer for ticket `number`: its id (or the `id` fault's value instead), its title."""
    path = DATA / "faults.json"
    faults = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    return {"id": faults["id"] if "id" in faults else f"T-{number}", "title": title}


def _padding() -> dict[str, str]:
    """`{"huge": BYTES}`: an answer that carries that much besides the ticket; `{"raw": …}`:
    a note the Raw middleware replaces."""
    faults = _faults()
    extra = {"note": RAW} if "raw" in faults else {}
    return {**extra, "padding": "x" * int(faults["huge"])} if faults.get("huge") else extra


def _raw_written(body: bytes, raw: Any) -> bytes:
    """`body` with the JSON string RAW as the `raw` fault's text — in the structured result
    (`"@@raw@@"`) and in its JSON text block (`\"@@raw@@\"`) — byte for byte."""
    value = str(raw).encode()
    escaped = json.dumps(str(raw))[1:-1].encode()
    body = body.replace(b'\\"' + RAW.encode() + b'\\"', escaped)
    return body.replace(b'"' + RAW.encode() + b'"', value)


class Raw:
    """ASGI middleware: with the `raw` fault, an answer is `_raw_written` on its way out."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        raw = _faults().get("raw") if scope["type"] == "http" else None
        if raw is None:
            await self.app(scope, receive, send)
            return

        async def rewriting(message: Any) -> None:
            if message["type"] == "http.response.start":  # its length changes: chunked
                headers = [(k, v) for k, v in message["headers"] if k.lower() != b"content-length"]
                message = {**message, "headers": headers}
            if message["type"] == "http.response.body":
                message = {**message, "body": _raw_written(message.get("body", b""), raw)}
            await send(message)

        await self.app(scope, receive, rewriting)


class Legacy:
    """ASGI middleware: the upstream as a server of the 2025 protocol, as many still are —
    with `{"legacy": true}` it answers the 2026 `server/discover` probe as such a server
    answers any request outside a session (400, JSON-RPC -32600), so the SDK's client falls
    back to `initialize` and works in the session (`Mcp-Session-Id`) that opens; with
    `{"hold_initialized": SECONDS}` it also marks that client's `notifications/initialized`
    (the file DIR/initialized) and holds it that long before serving it. The client sends
    nothing else meanwhile: a test can restart the upstream between a session's initialize
    and its first request."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        faults = _faults() if scope["type"] == "http" and scope["method"] == "POST" else {}
        if not faults.get("legacy"):
            await self.app(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if b'"server/discover"' in body:
            error = {"code": -32600, "message": "Bad Request: Missing session ID"}
            answer = json.dumps({"jsonrpc": "2.0", "id": None, "error": error}).encode()
            headers = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 400, "headers": headers})
            await send({"type": "http.response.body", "body": answer})
            return
        if b'"notifications/initialized"' in body and faults.get("hold_initialized"):
            (DATA / "initialized").write_text("", "utf-8")
            await asyncio.sleep(float(faults["hold_initialized"]))
        replayed = False

        async def again() -> Any:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, again, send)


class RawStdout(io.RawIOBase):
    """stdout for the stdio transport: each message `_raw_written` with the `raw` fault, as
    the Raw middleware does over HTTP (the SDK writes one whole line per flush). It has no
    file descriptor of its own, so the SDK writes through it rather than to fd 1."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        raw = _faults().get("raw")
        self.out.write(bytes(data) if raw is None else _raw_written(bytes(data), raw))
        self.out.flush()
        return len(data)


@server.tool(
    annotations=ToolAnnotations(title="Open a ticket", read_only_hint=False, destructive_hint=False)
)
async def tickets_create(title: str, ctx: Context) -> dict[str, Any]:
    """Open a help-desk ticket."""
    if title == "refuse me":
        raise ToolError("the help desk refuses this title")
    if title == "quote my token":  # a careless service: its error quotes the credential
        sent = (ctx.headers or {}).get("authorization", "")
        raise ToolError(f"not a valid token: {sent} ({json.dumps(sent)})")
    number = _record("tickets_create", {"title": title})
    await _misbehave()
    echo = {"seen": _authorization(ctx)} if title == "echo my token" else {}
    return {**_ticket(number, title), **_padding(), **echo}


def _authorization(ctx: Context) -> str:
    """The Authorization header the request carried (a careless service echoes it)."""
    return str((ctx.headers or {}).get("authorization", ""))


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
async def tickets_list() -> list[str]:
    """The tickets opened so far (a read: changes nothing)."""
    path = DATA / "calls.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    return [json.loads(line)["arguments"].get("title", "") for line in lines]


@server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=True))
async def tickets_purge(older_than_days: int) -> str:
    """Delete old tickets for good."""
    _record("tickets_purge", {"older_than_days": older_than_days})
    return "purged"


async def tickets_open(title: str, request_id: str) -> dict[str, Any]:
    """Open a ticket, remembering the client's request id (`--keyed`)."""
    number = await _applied("tickets_open", {"title": title, "request_id": request_id})
    await _misbehave()
    return _ticket(number, title)


async def tickets_find(request_id: str, ctx: Context) -> dict[str, Any]:
    """The ticket opened with this request id, or `{"found": false}` (a read)."""
    _found_by("tickets_find", request_id)
    if _faults().get("find_fails"):
        raise ToolError("the finder is down")
    echo = {"seen": _authorization(ctx)} if _faults().get("echo_token") else {}
    calls = DATA / "calls.jsonl"
    lines = calls.read_text(encoding="utf-8").splitlines() if calls.exists() else []
    for number, line in enumerate(lines, 1):
        if json.loads(line)["arguments"].get("request_id") == request_id:
            return {"id": f"T-{number}", **echo}
    return {"found": False}


async def tickets_find_text(request_id: str) -> str:
    """The finder of a server written for people: plain text, no structured result
    (`--keyed`)."""
    _found_by("tickets_find_text", request_id)
    calls = DATA / "calls.jsonl"
    lines = calls.read_text(encoding="utf-8").splitlines() if calls.exists() else []
    for number, line in enumerate(lines, 1):
        if json.loads(line)["arguments"].get("request_id") == request_id:
            return f"Ticket T-{number} was opened with this request id."
    return "No ticket has this request id."


def main() -> None:
    global DATA
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--data", required=True)
    parser.add_argument(
        "--transport", choices=["streamable-http", "stdio"], default="streamable-http"
    )
    parser.add_argument("--keyed", action="store_true", help="also tickets_open/tickets_find")
    args = parser.parse_args()
    if args.keyed:
        server.tool(annotations=ToolAnnotations(read_only_hint=False))(tickets_open)
        server.tool(annotations=ToolAnnotations(read_only_hint=True))(tickets_find)
        server.tool(annotations=ToolAnnotations(read_only_hint=True), structured_output=False)(
            tickets_find_text
        )
    DATA = Path(args.data)
    DATA.mkdir(parents=True, exist_ok=True)
    if args.transport == "stdio":
        sys.stdout = io.TextIOWrapper(RawStdout(sys.stdout.buffer), encoding="utf-8")
        server.run("stdio")
    else:
        import uvicorn

        app = Legacy(Raw(server.streamable_http_app()))
        uvicorn.run(app, host="127.0.0.1", port=args.port)


if __name__ == "__main__":
    main()
