"""runtime.storable: a service's JSON answer made storable, on its bytes — and read through
an MCP session's response stream (runtime.mcp._Read) in pieces cut anywhere."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from runtime.mcp import _Read
from runtime.storable import storable_escapes

ANSWER = (
    b'data: {"a": "x\\u0000y", "b": "\\ud800", "c": "\\ud83d\\ude00", "d": "\\\\ud800",\n'
    b'data: "e": "\\udc00\\u0041", "f": "\\\\\\ud800", "g": "\\u00e9\\ud800"}\n\n'
)


def test_only_nul_and_lone_halves_are_rewritten_and_the_length_is_kept() -> None:
    text = b'{"a": "x\\u0000y", "b": "\\ud800", "c": "\\ud83d\\ude00", "d": "\\\\ud800",'
    text += b' "e": "\\udc00\\u0041", "f": "\\\\\\ud800", "g": "\\u00e9\\ud800"}'
    kept = storable_escapes(text)
    assert len(kept) == len(text)
    assert json.loads(kept) == {
        "a": "x\ufffdy",
        "b": "\ufffd",
        "c": "\U0001f600",  # a pair is one character
        "d": "\\ud800",  # an escaped backslash, then text
        "e": "\ufffdA",
        "f": "\\\ufffd",
        "g": "\xe9\ufffd",
    }
    plain = b'{"id": "T-1", "note": "\\u00e9"}'
    assert storable_escapes(plain) is plain  # nothing to do: not copied


async def _pieces(chunks: list[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


def _read(chunks: list[bytes], limit: int = 0) -> bytes:
    async def read() -> bytes:
        return b"".join([piece async for piece in _Read(_pieces(chunks), limit)])

    return asyncio.run(read())


@pytest.mark.parametrize("cut", range(1, len(ANSWER)))
def test_an_answer_cut_anywhere_reads_as_it_would_whole(cut: int) -> None:
    assert _read([ANSWER[:cut], ANSWER[cut:]]) == storable_escapes(ANSWER)


def test_an_answer_in_bytes_of_one_reads_as_it_would_whole() -> None:
    assert _read([ANSWER[i : i + 1] for i in range(len(ANSWER))]) == storable_escapes(ANSWER)
