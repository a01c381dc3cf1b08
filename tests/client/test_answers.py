"""Successful HTTP answers the client cannot read, from a real little server on 127.0.0.1.

A 2xx that is not the API's answer — JSON of another shape, a garbled event stream, a body
its Content-Encoding does not decode — may come from a newer or broken server, a proxy, a
login portal. Whatever it is, a caller catching `HoldpointError` catches it: a
`TransportError` that says what answered, and whether the call may have been applied.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from holdpoint_client import AsyncClient, Client, HoldpointError, TransportError
from tests.httpservers import Server, answer_with

RUN = "00000000-0000-0000-0000-000000000000"
GOAL = {"scope": ["/orders"]}


def sync_read(url: str) -> Any:
    return Client(url, "token", backoff=0.01).get_run(RUN)


def async_write(url: str) -> Any:
    async def write() -> Any:
        async with AsyncClient(url, "token", backoff=0.01) as api:
            return await api.create_run("api-review", GOAL, external=True)

    return asyncio.run(write())


@pytest.mark.parametrize(
    "body",
    [
        b'{"status": "running"}',  # no run_id: KeyError
        b"[]",  # not an object: TypeError
        b'{"run_id": "r", "status": "running", "goal_rev": "two"}',  # ValueError
        b'{"run_id": "r", "status": "running", "lease": [1]}',  # AttributeError
    ],
)
def test_a_success_whose_json_does_not_fit_is_a_transport_error(
    serve: Callable[..., Server], body: bytes
) -> None:
    """A 200/201 with JSON that is not a run escaped the client as the KeyError, TypeError
    or ValueError its model raised on it: nothing a caller of the client expects, nothing
    naming what answered. It is a TransportError naming the call and what came back; a
    write may have been applied behind it."""
    server = serve(answer_with(200, body))
    with pytest.raises(TransportError, match=r"GET runs/.*HTTP 200 .*not the API's") as read:
        sync_read(server.url)
    assert read.value.may_have_applied is False
    with pytest.raises(TransportError, match=r"POST runs/: HTTP 200") as sent:
        async_write(server.url)
    assert sent.value.may_have_applied is True
    assert len(server.requests) == 2  # an answer, if unreadable: not asked again


@pytest.mark.parametrize(
    "lines",
    [
        b"id: 1\ndata: {not json\n\n",  # ValueError
        b'id: 1\ndata: {"seq": 1}\n\n',  # no type: KeyError
        b"id: 1\ndata: [1]\n\n",  # TypeError
    ],
)
def test_a_malformed_event_stream_line_is_a_transport_error(
    serve: Callable[..., Server], lines: bytes
) -> None:
    """A data line of the event stream that is not a journal entry escaped events(follow=
    True) as json's ValueError (or the model's KeyError): a caller following a run with
    `except HoldpointError` was not told. It is a TransportError naming the stream."""
    server = serve(answer_with(200, lines, content_type="text/event-stream"))
    with pytest.raises(HoldpointError, match="events/.*not a journal entry") as followed:
        list(Client(server.url, "token", backoff=0.01).events(RUN, follow=True))
    assert isinstance(followed.value, TransportError) and not followed.value.may_have_applied

    async def follow() -> list[Any]:
        async with AsyncClient(server.url, "token", backoff=0.01) as api:
            return [entry async for entry in api.events(RUN, follow=True)]

    with pytest.raises(TransportError, match="not a journal entry"):
        asyncio.run(follow())


def garbled(content_type: str = "application/json") -> Any:
    """Answers whose Content-Encoding says gzip, and whose body is not."""
    return answer_with(200, b"not gzip", ("Content-Encoding", "gzip"), content_type=content_type)


def test_a_body_its_content_encoding_does_not_decode_is_a_transport_error(
    serve: Callable[..., Server],
) -> None:
    """An answer whose body its Content-Encoding does not decode (a gzip header on plain
    bytes: a broken proxy or server) raised httpx.DecodingError — not an httpx
    TransportError, so neither retried nor wrapped: a caller catching HoldpointError was not
    told, and a write did not say it may have been applied. The server answered but what it
    said cannot be read: a read or a call safe to repeat is asked again, then raised as a
    TransportError; a call that is not safe to repeat (revising a goal, dispatching) is not
    repeated and may have been applied."""
    server = serve(garbled())
    retries = 2
    with pytest.raises(TransportError, match="DecodingError") as read:
        Client(server.url, "token", retries=retries, backoff=0.01).get_run(RUN)
    assert read.value.may_have_applied is False
    assert len(server.requests) == retries + 1

    with pytest.raises(TransportError, match=r"POST runs/.*/revisions/") as revised:
        Client(server.url, "token", retries=retries, backoff=0.01).revise(
            RUN, {}, expected_goal_rev=1
        )
    assert revised.value.may_have_applied is True
    assert len(server.requests) == retries + 2  # not repeated

    async def dispatch() -> Any:
        async with AsyncClient(server.url, "token", retries=retries, backoff=0.01) as api:
            return await api.dispatch(RUN, 1)

    with pytest.raises(TransportError, match=r"POST actions/.*/dispatch/") as sent:
        asyncio.run(dispatch())
    assert sent.value.may_have_applied is True
    assert len(server.requests) == retries + 3


def test_a_garbled_event_stream_body_is_a_transport_error(
    serve: Callable[..., Server],
) -> None:
    """The same for a run's event stream: events(follow=True) raised httpx.DecodingError
    out of the feed, sync and async. It is reopened like a lost connection, then raised as
    a TransportError."""
    server = serve(garbled("text/event-stream"))
    with pytest.raises(TransportError, match="events/"):
        list(Client(server.url, "token", retries=1, backoff=0.01).events(RUN, follow=True))

    async def follow() -> list[Any]:
        async with AsyncClient(server.url, "token", retries=1, backoff=0.01) as api:
            return [entry async for entry in api.events(RUN, follow=True)]

    with pytest.raises(TransportError, match="events/"):
        asyncio.run(follow())
    assert len(server.requests) == 4  # each feed: the stream, opened again once
