"""The MCP side of the gateway: the `mcp` SDK's server behind Holdpoint's authentication and
durable sessions, mounted by `config.asgi` at `/mcp/<tenant-slug>/` (streamable HTTP).

The SDK keeps a session's state in the memory of one process, which a restart loses. So its
session manager runs *stateless* (a fresh transport per request) and Holdpoint owns the
session: `Endpoint` authenticates every request (a usable agent token of the endpoint's
tenant, before the SDK sees a byte), issues `Mcp-Session-Id` at an `initialize` the SDK
answers with a result — the id of the session's run (gateway.calls.open_session), opened only
then — and re-adopts it on every later request, in
this process or the next one. A request for an unknown session gets 404, as the transport
spec says, so the client opens a new one.

Waiting for a reviewer: the call polls its action with short database reads on worker
threads (no thread or connection is held between polls), sending progress notifications
when the client gave a progressToken, for at most HOLDPOINT_MCP_WAIT_SECONDS; then (or at
once, without a progressToken) it answers "pending approval" with the request's link, and
the same call later gets the decided outcome (gateway.calls, "the same call").
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import anyio
import mcp_types as types
import pydantic_core
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connections
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_REQUEST, PARSE_ERROR
from starlette.types import Message, Receive, Scope, Send

from audit.canonical import CanonicalError, unique_keys
from gateway import calls

T = TypeVar("T")
SESSION_HEADER = b"mcp-session-id"
POLL_SECONDS = 0.5
# A waiting call reads its action every POLL_SECONDS but tells the client only this often
# (and at once): a host shows each notification, and a reviewer takes minutes, not ticks.
PROGRESS_SECONDS = 5.0
SCOPE_KEY = "holdpoint.mcp"


async def db(fn: Callable[..., T], *args: Any) -> T:
    """Run a short synchronous database operation on a worker thread; its connection is
    closed when it returns, so a waiting call holds none between polls."""

    def run() -> T:
        try:
            return fn(*args)
        finally:
            for connection in connections.all(initialized_only=True):
                connection.close()

    return await sync_to_async(run, thread_sensitive=False)()


def _caller(ctx: Any) -> tuple[calls.Caller, str]:
    state = ctx.request.scope[SCOPE_KEY] if ctx.request is not None else None
    if not state or not state.get("session"):
        raise MCPError(-32600, "no Holdpoint session: send initialize first")
    return state["caller"], state["session"]


async def list_tools(ctx: Any, params: types.PaginatedRequestParams | None) -> Any:
    caller, _ = _caller(ctx)
    listed = await db(calls.listing, caller)
    return types.ListToolsResult(
        tools=[
            types.Tool(
                name=item.name,
                title=item.title or None,
                description=item.description,
                input_schema=item.schema,
            )
            for item in listed
        ]
    )


def _progress_token(params: types.CallToolRequestParams) -> Any:
    meta = params.meta or {}
    return meta.get("progress_token", meta.get("progressToken"))


async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
    caller, session = _caller(ctx)
    try:
        call = await db(calls.parse, caller, session, params.name, params.arguments)
    except calls.CallError as exc:
        raise MCPError(exc.code, exc.message, exc.data) from None
    token = _progress_token(params)
    bound = settings.HOLDPOINT_MCP_WAIT_SECONDS if token is not None else 0
    started = time.monotonic()
    told = -PROGRESS_SECONDS
    while True:
        try:
            action = await db(calls.drive, caller, call)
        except calls.Busy:
            action = None
        except calls.Ended:
            raise MCPError(
                INVALID_REQUEST, "this session is finished: initialize a new session"
            ) from None
        said = await db(calls.answer, action)
        waited = time.monotonic() - started
        if not said.waiting or waited >= bound:
            break
        if waited - told >= PROGRESS_SECONDS:
            told = waited
            # On this request's own stream (the POST's SSE answer): there is no GET stream.
            await ctx.session.send_progress_notification(
                token, waited, bound, said.text, related_request_id=ctx.request_id
            )
        await anyio.sleep(POLL_SECONDS)
    result = _result(said)  # built before its delivery is recorded: one that fails is not
    if said.final and action is not None:
        await db(calls.settle_delivery, caller, call, action)
    return result


def _result(said: calls.Answer) -> types.CallToolResult:
    data: dict[str, Any] = {
        "content": said.content or [{"type": "text", "text": said.text}],
        "isError": said.is_error,
        "_meta": said.meta,
    }
    if said.structured is not None:
        data["structuredContent"] = said.structured
    return types.CallToolResult.model_validate(data)


def build_server() -> Server[Any]:
    return Server(
        "holdpoint",
        instructions=(
            "Holdpoint gateway: each tool call is recorded, may wait for a human reviewer, "
            "and is sent at most once. A PENDING answer is not a result: call again with "
            "the same arguments later."
        ),
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


class Endpoint:
    """The ASGI app mounted at /mcp/{tenant}: authentication and the durable session id in
    front of the SDK's stateless session manager."""

    def __init__(self, manager: StreamableHTTPSessionManager) -> None:
        self.manager = manager

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        headers = dict(scope["headers"])
        slug = str(scope.get("path_params", {}).get("tenant", ""))
        try:
            caller = await db(
                calls.authenticate, headers.get(b"authorization", b"").decode("latin-1"), slug
            )
        except calls.Refused as refused:
            await _plain(send, refused.status, refused.detail, www_auth=refused.status == 401)
            return
        method = scope["method"]
        session = headers.get(SESSION_HEADER, b"").decode("latin-1")
        if method == "GET":  # no server-initiated stream: every answer rides its POST
            await _plain(send, 405, "no GET stream; POST requests", allow="POST, DELETE")
            return
        if session:
            session = await db(calls.adopt, caller, session)
            if not session:
                await _plain(send, 404, "unknown or finished session: initialize a new one")
                return
        if method == "DELETE":
            if not session:
                await _plain(send, 400, "Bad Request: no Mcp-Session-Id")
                return
            try:
                await db(calls.close_session, caller, session)
            except calls.Busy:
                await _plain(send, 409, "a call of this session is being sent; try again")
                return
            await _plain(send, 204, "")
            return
        if method != "POST":
            await _plain(send, 405, "POST requests", allow="POST, DELETE")
            return
        body = await _body(receive, settings.HOLDPOINT_MCP_MAX_BODY_BYTES)
        if body is None:
            limit = settings.HOLDPOINT_MCP_MAX_BODY_BYTES
            await _plain(send, 413, f"request body larger than {limit} bytes")
            return
        try:
            first = _message(body)
        except _NotOne as refused:
            await _rpc_error(send, refused.code, refused.message)
            return
        if not session:
            if first.get("method") != "initialize":
                await _plain(send, 400, "Bad Request: no Mcp-Session-Id (initialize first)")
                return
            await self._open(scope, body, receive, send, caller, first)
            return
        if first.get("method") == "initialize":
            # The carried-on session's id again: the client's SDK then knows it (and sends
            # DELETE with it when it closes).
            send = _with_session(send, session)
        scope = {**scope, SCOPE_KEY: {"caller": caller, "session": session}}
        await self.manager.handle_request(scope, _replay(body, receive), send)

    async def _open(
        self,
        scope: Scope,
        body: bytes,
        receive: Receive,
        send: Send,
        caller: calls.Caller,
        first: dict[str, Any],
    ) -> None:
        """A new session's initialize: the SDK answers it into a buffer (it is one short
        message), and only an answer with a result opens the session — its run — and carries
        its id. One the SDK refuses (an Accept or Content-Type it does not serve, a
        notification, params it cannot read) is passed on as it is and leaves nothing
        behind: a bad client would otherwise leave an empty session run on the Runs pages,
        per request, until the idle sweep."""
        held = _Held()
        scope = {**scope, SCOPE_KEY: {"caller": caller, "session": ""}}
        await self.manager.handle_request(scope, _replay(body, receive), held)
        session = ""
        if held.answered(first.get("id")):
            client = (first.get("params") or {}).get("clientInfo") or {}
            session = await db(
                calls.open_session, caller, client if isinstance(client, dict) else {}
            )
        await held.flush(_with_session(send, session) if session else send)


class _NotOne(Exception):
    """The body is not one JSON-RPC message: answered with this JSON-RPC error, HTTP 400."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def _message(body: bytes) -> dict[str, Any]:
    """The body's JSON-RPC message as the SDK will read it — with its parser, pydantic-core,
    which refuses JSON nested past its limit as it refuses any other bad JSON (json.loads
    raised RecursionError there: a 500). _NotOne if the body is not JSON at all (parse
    error), or is JSON but not one object: a batch (an array), which MCP 2025-06-18 took out
    of the protocol, or a bare value (invalid request) — the same answer with or without a
    session (the SDK would answer a session's batch with its own -32602). A key twice in one
    object is a parse error too, as on the API (DESIGN.md: params are parsed strictly):
    pydantic-core keeps the last silently, so a call's arguments would be acted on as one
    reading while a host's log or a proxy reads the other."""
    try:
        data = pydantic_core.from_json(body)
    except ValueError:
        raise _NotOne(
            PARSE_ERROR, "Parse error: the body is not JSON (or nested too deep)"
        ) from None
    duplicate = _duplicate_key(body)
    if duplicate is not None:
        raise _NotOne(PARSE_ERROR, f"Parse error: {duplicate}")
    if isinstance(data, list):
        raise _NotOne(
            INVALID_REQUEST,
            "Invalid Request: JSON-RPC batches (a JSON array) are not served, as MCP has no "
            "batching since 2025-06-18: send one message per request",
        )
    if not isinstance(data, dict):
        raise _NotOne(INVALID_REQUEST, "Invalid Request: the body is not a JSON-RPC message")
    return data


def _duplicate_key(body: bytes) -> str | None:
    """What a key found twice in one object of `body` is refused with ("duplicate key 'k'",
    audit.canonical.unique_keys: the API's own check), else None. JSON pydantic-core read:
    nested within its limit, far inside the stack's; numbers are read as their text (only
    the keys matter here)."""
    try:
        json.loads(body, object_pairs_hook=unique_keys, parse_int=str, parse_float=str)
    except CanonicalError as found:
        return str(found)
    except ValueError:  # a spelling pydantic-core reads and json does not: not this check's
        return None
    return None


async def _rpc_error(send: Send, code: int, message: str) -> None:
    """A JSON-RPC error for no request (`id` null), HTTP 400 — as the SDK answers a session's
    bad JSON."""
    error = {"code": code, "message": message}
    await _json(send, 400, {"jsonrpc": "2.0", "id": None, "error": error})


async def _body(receive: Receive, limit: int) -> bytes | None:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


class _Held:
    """An answer kept back whole (an ASGI `send` that stores its messages) until the caller
    knows what it says."""

    def __init__(self) -> None:
        self.messages: list[Message] = []

    async def __call__(self, message: Message) -> None:
        self.messages.append(message)

    def answered(self, request_id: Any) -> bool:
        """Whether it is a 200 carrying a JSON-RPC result for `request_id` — as a JSON body or
        as one of its event stream's `data:` lines."""
        start = next((m for m in self.messages if m["type"] == "http.response.start"), None)
        if start is None or start["status"] != 200 or request_id is None:
            return False
        body = b"".join(
            m.get("body", b"") for m in self.messages if m["type"] == "http.response.body"
        )
        candidates = [body, *(line[5:] for line in body.splitlines() if line.startswith(b"data:"))]
        for text in candidates:
            try:
                data = json.loads(text)
            except ValueError:
                continue
            if isinstance(data, dict) and "result" in data and data.get("id") == request_id:
                return True
        return False

    async def flush(self, send: Send) -> None:
        for message in self.messages:
            await send(message)


def _with_session(send: Send, session: str) -> Send:
    async def stamped(message: Message) -> None:
        if message["type"] == "http.response.start":
            kept = [(k, v) for k, v in message.get("headers", []) if k.lower() != SESSION_HEADER]
            message = {**message, "headers": [*kept, (SESSION_HEADER, session.encode())]}
        await send(message)

    return stamped


async def _plain(
    send: Send, status: int, text: str, *, www_auth: bool = False, allow: str = ""
) -> None:
    headers: list[tuple[bytes, bytes]] = []
    if www_auth:
        headers.append((b"www-authenticate", b'Bearer realm="holdpoint"'))
    if allow:
        headers.append((b"allow", allow.encode()))
    await _json(send, status, None if status == 204 else {"error": text}, headers)


async def _json(
    send: Send, status: int, payload: Any, headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    """An answer of JSON (`payload`; None: no body) with `headers` besides its type."""
    body = b"" if payload is None else json.dumps(payload).encode()
    start = [(b"content-type", b"application/json"), *headers]
    await send({"type": "http.response.start", "status": status, "headers": start})
    await send({"type": "http.response.body", "body": body})


def mount() -> tuple[Any, Callable[[], Any]]:
    """(route, lifespan) for config.asgi: the endpoint and the session manager's run()."""
    from starlette.routing import Mount

    manager = StreamableHTTPSessionManager(
        app=build_server(),
        stateless=True,
        max_request_body_size=settings.HOLDPOINT_MCP_MAX_BODY_BYTES,
    )
    return Mount("/mcp/{tenant}", app=Endpoint(manager)), manager.run
