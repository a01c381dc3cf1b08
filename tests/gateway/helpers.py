"""A real MCP client for the gateway's tests: the `mcp` SDK's ClientSession over its
streamable HTTP client, run on its own event loop (a test is synchronous; the ORM is used
between sessions, never inside one)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx2
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

T = TypeVar("T")


@dataclass
class Progress:
    """The progress notifications one call received."""

    messages: list[str] = field(default_factory=list)

    async def __call__(self, progress: float, total: float | None, message: str | None) -> None:
        self.messages.append(message or "")


async def in_session(
    url: str,
    key: str,
    work: Callable[[ClientSession], Awaitable[T]],
    scheme: str = "Bearer",
    session_id: str = "",
    close: bool = True,
) -> T:
    """`session_id`: carry on that session (as a client that kept its id across a reconnect
    or a gateway restart does) instead of opening a new one. `close=False`: leave without
    the DELETE that ends the session (a host that just quits)."""
    headers = {"Authorization": f"{scheme} {key}"} if key else {}
    if session_id:
        headers["Mcp-Session-Id"] = session_id
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(120)) as http:
        async with streamable_http_client(url, http_client=http, terminate_on_close=close) as (
            read,
            write,
        ):
            async with ClientSession(read, write) as session:
                await session.initialize()
                return await work(session)


def session(url: str, key: str, work: Callable[[ClientSession], Awaitable[T]], **kw: Any) -> T:
    """One session, on a thread of its own (a browser test's thread already runs
    Playwright's event loop)."""
    value: T = Background(url, key, work, **kw).result()
    return value


class Background:
    """A client session running in a thread while the test does something else (a reviewer
    deciding in the browser); `result()` waits for it."""

    def __init__(
        self, url: str, key: str, work: Callable[[ClientSession], Awaitable[Any]], **kw: Any
    ) -> None:
        self.box: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._run, args=(url, key, work, kw), daemon=True)
        self.thread.start()

    def _run(
        self, url: str, key: str, work: Callable[[ClientSession], Awaitable[Any]], kw: Any
    ) -> None:
        try:
            self.box["value"] = asyncio.run(in_session(url, key, work, **kw))
        except BaseException as exc:  # noqa: BLE001 (re-raised in the test's thread)
            self.box["error"] = exc

    def result(self, timeout: float = 120) -> Any:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError("the MCP client session did not end")
        if "error" in self.box:
            raise self.box["error"]
        return self.box["value"]


def text(result: Any) -> str:
    return " ".join(getattr(block, "text", "") for block in result.content)
