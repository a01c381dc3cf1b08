"""runtime.storable: a service's JSON answer made storable, on its bytes — and read through
an MCP session's response stream (runtime.mcp._Read) in pieces cut anywhere."""

from __future__ import annotations

import asyncio
import codecs
import json
from collections.abc import AsyncIterator

import pytest

from runtime.mcp import _Read
from runtime.storable import TOO_LARGE, storable_encoding, storable_escapes

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


LINES = b'{"id": 1, "note": "\\u0000"}\n' + b'{"id": 2, "pad": "' + b"x" * 100 + b'"}\n{"id": 3}\n'


def _decoded(chunks: list[bytes], limit: int) -> str:
    """What the MCP SDK's stdio reader gets (anyio's TextReceiveStream: an incremental
    decoder of the named encoding, fed each chunk as it comes)."""
    decoder = codecs.getincrementaldecoder(storable_encoding(limit))()
    return "".join(decoder.decode(chunk) for chunk in chunks) + decoder.decode(b"", True)


@pytest.mark.parametrize("cut", range(1, len(LINES)))
def test_a_line_past_the_cap_is_the_marker_wherever_the_pipe_cuts_it(cut: int) -> None:
    """A stdio server's answers are decoded line by line, each held to the cap: the line of
    128 bytes is never held whole, it reads as TOO_LARGE, and the lines around it are
    read as they are (made storable)."""
    lines = _decoded([LINES[:cut], LINES[cut:]], limit=64).split("\n")
    assert lines == ['{"id": 1, "note": "\\ufffd"}', TOO_LARGE, '{"id": 3}', ""]
    assert _decoded([LINES[:cut], LINES[cut:]], limit=0) == storable_escapes(LINES).decode()


def test_a_line_past_the_cap_that_never_ends_is_not_held() -> None:
    decoder = codecs.getincrementaldecoder(storable_encoding(64))()
    assert decoder.decode(b'{"id": 1}\n{"pad": "' + b"x" * 100) == '{"id": 1}\n' + TOO_LARGE + "\n"
    for _ in range(100):
        assert decoder.decode(b"x" * 65536) == ""
    assert decoder.getstate()[0] == b""  # nothing of it is kept
    assert decoder.decode(b'"}\n{"id": 2}\n') == '{"id": 2}\n'
