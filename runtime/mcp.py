"""Upstream MCP servers: sessions with them, and sending `executor: mcp` tools to them
(API.md, "Tools as data"; issue 19). Importing their tools as definitions is
runtime.mcpimport's, over the sessions opened here (`run_session`).

Holdpoint is the MCP *client* here, through the official `mcp` SDK, one short-lived session
per import or call (a worker holds no connection between actions, and a session cannot leak
one action's state into the next). The SDK is asyncio; workers are synchronous, so each
session runs in `asyncio.run` on a helper thread, with every database read done before.

A streamable HTTP upstream is held to the rules of http tools (runtime.outbound): its host
must be allowed, the name is resolved once and every address checked, and the connection
goes to the vetted address with the real name in `Host` and TLS's SNI.

What a call's answer means for the effect (runtime.tools.CallResult):
- a result with `isError` false → applied; the proof id is the result's own id (the
  definition's `result.external_id` over `structuredContent`) or else the action's
  idempotency key, and the result is recorded; something there that is no id (true, "",
  null, an object) proves nothing → unknown;
- `isError` true, or a protocol error saying the request was not acceptable (unknown
  method, invalid params) → refused for good — one the SDK's client made up because it
  could not read the answer is no such word: unknown;
- no session could be opened (refused connection, failed handshake), or its `tools/call`
  never left (over streamable HTTP: its POST never handed to a connection, as when a
  2025-protocol server's `notifications/initialized` fails and the SDK's writer stops;
  `_may_have_left`) → refused, transient: `tools/call` was never sent; nor taken when the
  upstream answers it with 404 for the session it opened (it restarted, or ended the
  session: MCP has it answer any request of the session so) → refused, transient: the
  retry opens a new session;
- a timeout or a lost connection after `tools/call` was sent → unknown. MCP has no
  idempotency contract: the ledger hands the question to a person (`manual_review`) instead
  of sending again — unless the definition declares a lookup (dedup `lookup`): every call
  then carries the action's key in `mcp.key_argument`, and reconciliation asks the upstream's
  lookup tool for the effect with that key (found → confirmed; a clean answer without it →
  absent; an error or no answer → ask again later, then a person).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import httpx
import httpx2
from django.conf import settings
from mcp import Client, MCPError, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult

from runtime import jsonpaths, outbound
from runtime.crypto import Secret, SecretUnreadable
from runtime.models import McpServer, McpTransport
from runtime.storable import TOO_LARGE, finite, storable_encoding, storable_escapes
from runtime.tools import (
    CallResult,
    Dedup,
    LookupResult,
    Tool,
    credential_for_run,
    found_in,
    masked,
    masked_answer,
    tenant_of_run,
    usable_id,
)

T = TypeVar("T")
# JSON-RPC errors that say the server did not take the request: nothing was done.
NOT_TAKEN = {-32700, -32600, -32601, -32602}
# How the SDK's client begins the errors it makes up itself, with some of those codes, when
# the upstream did answer the request but not readably (a body it cannot parse, a content
# type it does not serve, 202 without an answer): the upstream may have acted on it.
UNREADABLE_ANSWER = (
    "Failed to parse",
    "Unexpected content type",
    "server answered a request with 202",
)


@dataclass(frozen=True)
class Target:
    """How to reach one server for one session, every check already made."""

    transport: str
    url: str = ""
    vetted: outbound.Vetted | None = None
    command: str = ""
    args: tuple[str, ...] = ()
    headers: dict[str, str] = field(default_factory=dict)
    timeout: float = 10.0
    max_bytes: int = 0  # the most one answer may carry (0: no cap)


def target_for(
    server: McpServer, secret: Secret | None, timeout: float | None = None, max_bytes: int = 0
) -> Target:
    """The server as this connection may reach it. OutboundRefused (host or address not
    allowed, stdio off) or httpx.ConnectError (the name does not resolve): nothing sent.
    `max_bytes`: an answer longer than that (a streamable HTTP response, a stdio server's
    line) is dropped as it is read."""
    headers = {"Authorization": f"Bearer {secret.reveal()}"} if secret is not None else {}
    seconds = float(timeout if timeout is not None else server.timeout_seconds)
    if server.transport == McpTransport.STDIO:
        if not settings.HOLDPOINT_MCP_STDIO:
            raise outbound.OutboundRefused(
                "host_not_allowed", "stdio MCP servers are off (HOLDPOINT_MCP_STDIO)"
            )
        return Target(
            McpTransport.STDIO,
            command=server.command,
            args=tuple(server.args),
            timeout=seconds,
            max_bytes=max_bytes,
        )
    outbound.check_headers(headers)  # a credential no header can carry: never quoted
    return Target(
        McpTransport.STREAMABLE_HTTP,
        url=server.url,
        vetted=outbound.vet(server.url),
        headers=headers,
        timeout=seconds,
        max_bytes=max_bytes,
    )


class SessionGone(Exception):
    """The upstream answered `tools/call` with 404 for the session it had opened: it no
    longer has that session (it restarted, or ended it), and MCP has it answer so any
    request of it — the request was not taken."""


class SessionStuck(TimeoutError):
    """A session's thread did not end in time, even cancelled: it may still send anything."""


class AnswerTooLarge(Exception):
    """A stdio server wrote an answer past the cap: the session was ended without reading
    the rest of it (a streamable HTTP answer past it is an httpx2.ReadError, from `_Read`)."""


class _Pinned(httpx2.AsyncBaseTransport):
    """Sends every request of the session to the vetted address, for the vetted host only
    (the SDK follows same-origin redirects itself: another host is refused here too). Keeps
    the methods whose request a session's 404 answered (`gone`), and adds to `left` the
    method of each POST that may have reached the upstream: every one handed to the
    connection, unless no connection was made (refused, or not made in time: not a byte of
    it was written)."""

    def __init__(
        self, vetted: outbound.Vetted, max_bytes: int = 0, left: set[str] | None = None
    ) -> None:
        self.vetted = vetted
        self.max_bytes = max_bytes
        self.inner = httpx2.AsyncHTTPTransport(verify=_ssl_context(), trust_env=False)
        self.gone: set[str] = set()
        self.left = left if left is not None else set()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        if (request.url.host or "").lower() != self.vetted.host or request.url.scheme != (
            self.vetted.scheme
        ):
            raise httpx2.ConnectError(f"not sent: {request.url.host} is not the vetted host")
        request.url = request.url.copy_with(host=self.vetted.addresses[0].split("%", 1)[0])
        if self.vetted.scheme == "https":
            request.extensions = {**request.extensions, "sni_hostname": self.vetted.host}
        method = _method_of(request.content) if request.method == "POST" else ""
        try:
            response = await self.inner.handle_async_request(request)
        except (httpx2.ConnectError, httpx2.ConnectTimeout):
            raise  # no connection was made: not a byte of the request was written
        except BaseException:
            self.left.add(method)  # some of it may have been written before this
            raise
        self.left.add(method)
        if response.status_code == 404 and request.method == "POST":
            if request.headers.get("mcp-session-id"):
                self.gone.add(method)
        response.stream = _Read(response.stream, self.max_bytes)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


def _method_of(body: bytes) -> str:
    try:
        message = json.loads(body)
    except ValueError:
        return ""
    return str(message.get("method", "")) if isinstance(message, dict) else ""


class _Read(httpx2.AsyncByteStream):
    """An answer as the SDK may read it. Up to `limit` bytes (0: no cap), as http tools' are
    (runtime.outbound): past it the connection is dropped, so an upstream's megabytes never
    fill a worker's or the gateway's memory, nor an action's result. And storable: each
    line (an event-stream line, or a JSON body, where no escape spans a line) with its NUL
    and lone surrogate escapes rewritten (runtime.storable) — the SDK's parser refuses a
    message holding a lone surrogate, which would lose the proof of an applied effect."""

    def __init__(self, inner: Any, limit: int) -> None:
        self.inner, self.limit = inner, limit

    async def __aiter__(self) -> AsyncIterator[bytes]:
        seen = 0
        held = b""  # the last line's start, until its end comes
        async for chunk in self.inner:
            seen += len(chunk)
            if self.limit and seen > self.limit:
                raise httpx2.ReadError(
                    f"the answer is larger than {self.limit} bytes "
                    "(HOLDPOINT_TOOL_MAX_RESPONSE_BYTES)"
                )
            lines, newline, held = (held + chunk).rpartition(b"\n")
            if newline:
                yield storable_escapes(lines + newline)
        if held:
            yield storable_escapes(held)

    async def aclose(self) -> None:
        await self.inner.aclose()


_ssl: list[ssl.SSLContext] = []


def _ssl_context() -> ssl.SSLContext:
    if not _ssl:
        _ssl.append(httpx.create_ssl_context(trust_env=False))
    return _ssl[0]


async def _session(
    target: Target, work: Callable[[Client], Awaitable[T]], left: set[str] | None = None
) -> T:
    """Open a session, do `work` in it, close it. Either transport's answers are made
    storable before the SDK parses them: a stdio server's by the encoding its output is
    decoded with, a streamable HTTP server's by `_Read`. `left`, for a streamable HTTP
    server: gets the method of each request that may have reached it (`_Pinned`)."""
    if target.transport == McpTransport.STDIO:
        return await _stdio_session(target, work)
    assert target.vetted is not None
    pinned = _Pinned(target.vetted, target.max_bytes, left)
    http = httpx2.AsyncClient(
        transport=pinned,
        headers=target.headers,
        timeout=httpx2.Timeout(target.timeout),
        follow_redirects=False,
        trust_env=False,
    )
    async with http:
        transport = streamable_http_client(target.url, http_client=http)
        async with Client(transport, read_timeout_seconds=target.timeout, cache=None) as client:
            try:
                return await work(client)
            except MCPError as exc:
                if "tools/call" in pinned.gone:
                    raise SessionGone(f"the upstream no longer has the session: {exc}") from exc
                raise


async def _stdio_session(target: Target, work: Callable[[Client], Awaitable[T]]) -> T:
    """A stdio server's session. Its answers are decoded by `storable_encoding`, which also
    holds each line to `max_bytes`: the SDK's reader keeps a line until its end comes, so a
    server writing megabytes on one line would fill the worker's memory. A line past the cap
    reaches the session as a line it cannot parse, `TOO_LARGE`; the SDK only reports that
    to the message handler and would wait for an answer until the timeout, so the handler
    ends the session at once (as a streamable HTTP connection is dropped past the cap) —
    AnswerTooLarge: the server may have acted on the request whose answer it was."""
    params = StdioServerParameters(
        command=target.command,
        args=list(target.args),
        encoding=storable_encoding(target.max_bytes),
    )

    async def watch(message: Any) -> None:
        if isinstance(message, Exception) and TOO_LARGE in str(message):
            ended.cancel()
        await anyio.lowlevel.checkpoint()

    done: list[T] = []  # a line past the cap may come after the answer, while closing
    with anyio.CancelScope() as ended:
        async with Client(
            params, read_timeout_seconds=target.timeout, cache=None, message_handler=watch
        ) as client:
            done.append(await work(client))
    if done:
        return done[0]
    raise AnswerTooLarge(
        f"the answer is larger than {target.max_bytes} bytes (HOLDPOINT_TOOL_MAX_RESPONSE_BYTES)"
    )


def _run(make: Callable[[], Awaitable[T]], timeout: float) -> T:
    """Run an SDK coroutine from synchronous code: its own event loop on a helper thread
    (the caller may itself be inside a loop), the whole of it bounded by `timeout`."""
    box: dict[str, Any] = {}

    async def bounded() -> T:
        return await asyncio.wait_for(make(), timeout)

    def target() -> None:
        try:
            box["value"] = asyncio.run(bounded())
        except BaseException as exc:  # noqa: BLE001 (re-raised in the caller's thread)
            box["error"] = exc

    thread = threading.Thread(target=target, name="mcp-session", daemon=True)
    thread.start()
    thread.join(timeout + 10)
    if thread.is_alive():
        raise SessionStuck(f"the MCP session did not end within {timeout:g}s")
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value


def run_session(
    target: Target, work: Callable[[Client], Awaitable[T]], left: set[str] | None = None
) -> T:
    """`_session` from synchronous code (`_run`), the whole session bounded by the target's
    timeout: how a worker calls a tool and an import lists an upstream's tools."""
    return _run(lambda: _session(target, work, left), target.timeout)


def describe(exc: BaseException) -> str:
    """A failed session's error in words, for an action's detail or an import's refusal:
    each exception of a group (the SDK's task groups wrap the cause), each cut short."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe(inner) for inner in exc.exceptions)
    return f"{type(exc).__name__}: {exc}"[:500]


def _not_taken(error: MCPError) -> bool:
    """Whether the upstream said it did not take the request — not the SDK's client, which
    could not read what the upstream answered."""
    return error.code in NOT_TAKEN and not error.message.startswith(UNREADABLE_ANSWER)


E = TypeVar("E", bound=BaseException)


def _found(exc: BaseException, kind: type[E]) -> E | None:
    """`exc` if it is a `kind`, else the first `kind` in it (an exception group)."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _found(inner, kind)
            if found is not None:
                return found
    return None


# --- sending -----------------------------------------------------------------------------


def _dump(result: CallToolResult) -> dict[str, Any]:
    """What an action stores of a result: its content, structured content (NaN and ±Infinity
    as their text, as an http tool's answer keeps them: the JSON dump would make them null)
    and error flag."""
    data = result.model_dump(by_alias=True, mode="json", exclude_none=True)
    if result.structured_content is not None:
        data["structuredContent"] = finite(result.structured_content)
    return {key: data[key] for key in ("content", "structuredContent", "isError") if key in data}


def _error_text(result: CallToolResult) -> str:
    texts = [str(getattr(block, "text", "")) for block in result.content]
    return " ".join(text for text in texts if text)[:1000] or "the tool reported an error"


def _masked(text: str, secret: Secret | None) -> str:
    """`text` with the credential a session carried masked (runtime.tools.masked)."""
    return masked(text, secret.reveal()) if secret is not None else text


@dataclass
class McpTool(Tool):
    """A tool of an upstream MCP server, sent by Holdpoint's workers with `tools/call`."""

    server: str = ""
    upstream_tool: str = ""
    id_path: str = "$.id"
    key_argument: str = ""
    lookup_tool: str = ""
    lookup_arguments: Mapping[str, Any] = field(default_factory=dict)
    found_path: str = "$.id"

    @property
    def mcp_server(self) -> str:
        return self.server

    def _server(self, run_id: str) -> McpServer | None:
        tenant_id = tenant_of_run(run_id)
        if tenant_id is None:
            return None
        return McpServer.objects.filter(tenant_id=tenant_id, name=self.server).first()

    def call(self, params_text: str, *, key: str, fence: int, run_id: str) -> CallResult:
        """Send the call. What the upstream says goes into the action's error or, applied,
        its result and id (every member of the tenant reads them) and the journal: the
        credential the session carried is masked wherever it quotes it back, as an http
        tool's answer is (`runtime.tools.masked_answer`) — the one read for this call, not a
        read after it (a secret replaced meanwhile is not the one quoted)."""
        server = self._server(run_id)
        if server is None:
            return CallResult("refused", detail=f"no active MCP server {self.server!r}")
        if not server.active:
            # Turned off after the ledger's re-check before `sent` (runtime.ledger.mark_sent):
            # nothing left, so not a failure — the retry meets that re-check, which keeps the
            # action unsent until a person turns the server on again.
            return CallResult(
                "refused", transient=True, detail=f"no active MCP server {self.server!r}"
            )
        try:
            secret = credential_for_run(self.credential, run_id)
        except SecretUnreadable as exc:
            return CallResult("refused", transient=True, detail=str(exc))
        result = self._send(server, secret, params_text, key)
        return masked_answer(result, secret.reveal()) if secret is not None else result

    def _send(
        self, server: McpServer, secret: Secret | None, params_text: str, key: str
    ) -> CallResult:
        try:
            target = target_for(
                server,
                secret,
                timeout=self.timeout,
                max_bytes=settings.HOLDPOINT_TOOL_MAX_RESPONSE_BYTES,
            )
        except outbound.OutboundRefused as exc:
            return CallResult("refused", detail=f"{exc.code}: {exc.detail}", unsent=True)
        except httpx.ConnectError as exc:
            return CallResult("refused", transient=True, detail=str(exc))
        arguments = json.loads(params_text)
        if self.key_argument:
            arguments[self.key_argument] = key
        opened = threading.Event()
        left: set[str] = set()

        async def calling(client: Client) -> CallToolResult:
            opened.set()
            return await client.call_tool(self.upstream_tool, arguments)

        try:
            result = run_session(target, calling, left)
        except BaseException as exc:  # noqa: BLE001 (the SDK's errors, grouped or not)
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            return self._failed(exc, _may_have_left(target, exc, opened.is_set(), left))
        if result.is_error:
            return CallResult("refused", detail=f"{self.upstream_tool}: {_error_text(result)}")
        proof = self._proof(result, key)
        if proof is None:  # applied, it says, but with nothing that proves it: unknown
            detail = f"{self.upstream_tool}: {self.id_path} in its result is not an id"
            return CallResult("unknown", result=_dump(result), detail=detail)
        return CallResult("applied", external_id=proof, result=_dump(result))

    def _failed(self, exc: BaseException, sent: bool) -> CallResult:
        detail = describe(exc)
        if not sent:  # tools/call certainly never left (`_may_have_left`)
            return CallResult("refused", transient=True, detail=f"not sent: {detail}")
        if _found(exc, SessionGone) is not None:  # not taken; a new session may be opened
            return CallResult("refused", transient=True, detail=f"not taken: {detail}")
        error = _found(exc, MCPError)
        if error is not None and _not_taken(error):
            return CallResult("refused", detail=f"{self.upstream_tool}: {detail}")
        return CallResult("unknown", detail=f"after tools/call was sent: {detail}")

    def lookup(self, key: str, params_text: str = "{}", *, run_id: str) -> LookupResult:
        """Ask the upstream's lookup tool for the effect with `key`. `found` None when it
        could not tell (no session, an error result, a timeout): never "absent" then."""
        if self.dedup_mode() != Dedup.LOOKUP or not self.lookup_tool:
            return LookupResult(found=None, detail=f"{self.name} has no lookup by key")
        server = self._server(run_id)
        if server is None or not server.active:
            return LookupResult(found=None, detail=f"no active MCP server {self.server!r}")
        values = {**json.loads(params_text), "idempotency_key": key}
        arguments = {
            name: values.get(value[1:-1]) if _is_placeholder(value) else value
            for name, value in self.lookup_arguments.items()
        }
        secret: Secret | None = None
        try:
            secret = credential_for_run(self.credential, run_id)
            target = target_for(
                server,
                secret,
                timeout=self.timeout,
                max_bytes=settings.HOLDPOINT_TOOL_MAX_RESPONSE_BYTES,
            )
            result = run_session(target, lambda c: c.call_tool(self.lookup_tool, arguments))
        except BaseException as exc:  # noqa: BLE001 (refused, unreachable, the SDK's errors)
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            detail = _masked(f"lookup failed: {describe(exc)}", secret)
            return LookupResult(found=None, detail=detail)
        if result.is_error:
            detail = _masked(f"lookup: {_error_text(result)}", secret)
            return LookupResult(found=None, detail=detail)
        content = _structured(result)
        if content is None:  # plain text: it may name the effect in words, so not "absent"
            return LookupResult(
                found=None, detail="lookup: the answer is neither structured nor JSON"
            )
        verdict = found_in(self.found_path, content, bare_object_is_none=True)
        if not verdict.found:
            return verdict
        found = replace(verdict, external_id=verdict.external_id[:200], result=_dump(result))
        return masked_answer(found, secret.reveal()) if secret is not None else found

    def _proof(self, result: CallToolResult, key: str) -> str | None:
        """The upstream's own id for the effect if its structured result has one, else the
        action's key (stable: the same action always has the same proof). None when the
        result puts something that is no id where the id belongs — true, false, "", null, an
        object (tools.usable_id, as a lookup's answer is judged): that proves nothing, so
        the outcome is unknown and the tool's contract settles it."""
        content = result.structured_content
        if not isinstance(content, Mapping):
            return key
        try:
            matched = jsonpaths.compile_path(self.id_path).values(content)
        except jsonpaths.JsonPathError:
            return None
        if not matched:
            return key
        return str(matched[0])[:200] if usable_id(matched[0]) else None


def _may_have_left(target: Target, exc: BaseException, opened: bool, left: set[str]) -> bool:
    """Whether a failed session's `tools/call` may have reached the upstream. Over stdio,
    once the session was open (`opened`: the handshake done). Over streamable HTTP, only if
    its POST was handed to a connection (`_Pinned.left`): an open session is not enough —
    when a 2025-protocol server's `notifications/initialized` fails (it died, or dropped the
    connection), the SDK's writer stops before it sends the call, which then ends in
    "Connection closed"; and a POST refused at connect was never written. A session whose
    thread has not ended (`SessionStuck`) may still send it."""
    if _found(exc, SessionStuck) is not None:
        return True
    if target.transport == McpTransport.STDIO:
        return opened
    return "tools/call" in left


def _is_placeholder(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("{") and value.endswith("}")


def _structured(result: CallToolResult) -> Any:
    """What a lookup's `found` path reads: the structured result, else the first text block
    parsed as JSON (servers that answer in text only), else None: the lookup cannot tell."""
    if result.structured_content is not None:
        return result.structured_content
    for block in result.content:
        text = getattr(block, "text", None)
        if isinstance(text, str):
            try:
                return json.loads(text)
            except (ValueError, RecursionError):  # not JSON, or nested past the parser
                return None
    return None


def build(spec: Mapping[str, Any], fields: dict[str, Any]) -> Tool:
    """The tool of an `executor: mcp` definition (`tools.register_sender`, runtime.apps)."""
    lookup = spec.get("lookup") or {}
    return McpTool(
        **fields,
        server=spec["mcp"]["server"],
        upstream_tool=spec["mcp"]["tool"],
        id_path=spec.get("result", {}).get("external_id", "$.id"),
        key_argument=spec["mcp"].get("key_argument", ""),
        lookup_tool=lookup.get("tool", ""),
        lookup_arguments=dict(lookup.get("arguments", {})),
        found_path=lookup.get("found", "$.id"),
    )
