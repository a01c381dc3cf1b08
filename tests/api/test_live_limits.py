"""Live event streams per account (HOLDPOINT_STREAMS_PER_TOKEN) through the real ASGI server
(`uvicorn config.asgi`): each open stream holds one of the web process's file descriptors,
so one token must not hold hundreds open; a stream that ends gives its place back."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.models import Role
from tests import procs
from tests.api import new_run, take_lease
from tests.api.live import STREAM, finish_external, headers, web_server
from tests.conftest import Persona, make_persona

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
LIMIT = 3


@dataclass
class Stream:
    answer: httpx.Response
    lines: Iterator[str]

    def read_to_end(self, seconds: float = 20) -> list[str]:
        """Every line until the server ends the stream; fails if it runs `seconds` more."""
        deadline, got = time.monotonic() + seconds, []
        for line in self.lines:
            got.append(line)
            if time.monotonic() > deadline:
                pytest.fail(f"the stream still runs after {seconds} s: {got[-3:]}")
        return got


def _opener(stack: contextlib.ExitStack, web: str, sent: dict[str, str]) -> Callable[[str], Stream]:
    """Opens a stream of `path`, kept open until `stack` closes (or the test closes it). Each
    is kept here too: a line iterator dropped by the test closes its connection when it is
    collected (httpcore closes a stream left half read)."""
    kept: list[Stream] = []

    def open_(path: str) -> Stream:
        answer = stack.enter_context(
            httpx.stream("GET", web + path, params=STREAM, headers=sent, timeout=30)
        )
        if answer.status_code != 200:
            answer.read()
            return Stream(answer, iter(()))
        lines = answer.iter_lines()
        assert next(lines) == ": stream open"  # the server has let it in
        kept.append(Stream(answer, lines))
        return kept[-1]

    return open_


def _let_in(open_: Callable[[str], Stream], path: str) -> Stream:
    """The next stream of `path` let in, once the server noticed one ended (bounded)."""

    def tried() -> Stream | None:
        stream = open_(path)
        return stream if stream.answer.status_code == 200 else None

    return procs.wait_for(tried, timeout=15, every=0.2)


def _refused(stream: Stream) -> None:
    answer = stream.answer
    assert answer.status_code == 429, answer.status_code
    assert answer.headers["content-type"].startswith("application/problem+json")
    assert answer.json()["code"] == "throttled" and answer.json()["status"] == 429
    assert answer.headers["Retry-After"] == "15"  # a keep-alive interval


def test_an_account_holds_at_most_its_streams_open_and_an_ended_one_frees_its_place(
    django_db_blocker: Any, tmp_path: Path, agent_a: Persona
) -> None:
    """LIMIT streams of one token open (run events and approvals alike), the next is 429
    `throttled` in the problem format with Retry-After — another account's still opens.
    A stream whose client left frees its place, and so does one the server ended (its run
    finished): the next one is let in, and the one after it refused again."""
    finishing = new_run(agent_a.api())["run_id"]
    fence = take_lease(agent_a.api(), finishing)
    waiting = new_run(agent_a.api())["run_id"]  # queued: its stream stays open
    runs = f"/api/v1/runs/{finishing}/events/", f"/api/v1/runs/{waiting}/events/"
    approvals = "/api/v1/approvals/"
    other = make_persona(agent_a.tenant, "agent-a2", Role.AGENT)
    limit = {"HOLDPOINT_STREAMS_PER_TOKEN": str(LIMIT)}
    with (
        web_server(django_db_blocker, tmp_path / "web.log", "holdpoint-web-slots", **limit) as (
            _,
            web,
        ),
        contextlib.ExitStack() as stack,
    ):
        open_ = _opener(stack, web, headers(agent_a))
        ending, kept, leaving = open_(runs[0]), open_(runs[1]), open_(approvals)
        assert {s.answer.status_code for s in (ending, kept, leaving)} == {200}
        _refused(open_(runs[1]))
        _refused(open_(approvals))
        assert _opener(stack, web, headers(other))(approvals).answer.status_code == 200

        # The client gone: its place is free again, and only its one.
        leaving.answer.close()
        _let_in(open_, approvals)
        _refused(open_(runs[1]))

        # The run finished: the server ends its stream, and its place is free again.
        finish_external(agent_a, finishing, fence, 0)
        assert "event: step_committed" in ending.read_to_end()
        _let_in(open_, runs[1])
        _refused(open_(approvals))
