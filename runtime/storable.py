"""A service's JSON answer made storable, for every sender: http tools (runtime.wire) and
MCP upstreams (runtime.mcp), over streamable HTTP or stdio.

An answer is the proof of an effect that happened: refusing to store it would leave that
effect unrecorded (a step failure, an action left `sent`, a person asked). Yet JSON brings
in what no column takes: a `\\u0000` escape (PostgreSQL's text and JSON refuse NUL), a lone
surrogate escape such as `\\ud800` (UTF-8 cannot hold it; the MCP SDK's parser refuses the
whole message for it), and, outside JSON proper, NaN and ±Infinity (which Python's parser
and pydantic's read). The escapes are rewritten in the answer's bytes, before any parser
sees them (for a stdio upstream, whose answers the SDK decodes itself, by the encoding
`storable_encoding` names, which also holds each answer to a size cap); the numbers are kept
as their text.
"""

from __future__ import annotations

import codecs
import functools
import math
import re
from typing import Any

# Any escape that may need rewriting: \u0000, or one half of a surrogate pair.
_SUSPECT = re.compile(rb"\\u(?:0000|[dD][89a-fA-F])")
# One escape of a JSON string, scanned from the left so that `\\` (an escaped backslash)
# is consumed whole and never read as the start of another escape: a surrogate pair, a
# lone half, \u0000, or any other (kept as it is).
_ESCAPE = re.compile(
    rb"\\(?:u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}"
    rb"|u[dD][89a-fA-F][0-9a-fA-F]{2}|u0000|.)",
    re.DOTALL,
)
REPLACEMENT = rb"\ufffd"  # the escape of U+FFFD: as long as what it replaces


def storable_escapes(body: bytes) -> bytes:
    """JSON text with each `\\u0000` and each lone surrogate escape as `\\ufffd` (U+FFFD, the
    replacement character), everything else byte for byte — the same length, so a
    Content-Length still holds. A pair that makes one character is kept. Costs one search
    for an answer that has no such escape."""
    if not _SUSPECT.search(body):
        return body
    return _ESCAPE.sub(_rewritten, body)


def _rewritten(match: re.Match[bytes]) -> bytes:
    token = match.group()
    return REPLACEMENT if len(token) == 6 and _SUSPECT.match(token) else token


class _StorableLines(codecs.BufferedIncrementalDecoder):
    """UTF-8 read a whole line at a time (no escape spans a line of JSON text), each line
    `storable_escapes` first; a line's start is held until its end comes. With a `limit`
    (bytes), a line longer than that is never held whole: once past it, the line is
    `TOO_LARGE` instead, and the rest of it is dropped as it comes."""

    limit = 0  # the longest line decoded (0: no cap)

    def __init__(self, errors: str = "strict") -> None:
        super().__init__(errors)
        self.dropping = False  # the rest of a line past the limit is still coming

    def reset(self) -> None:
        super().reset()
        self.dropping = False

    def _buffer_decode(self, data: Any, errors: str, final: bool) -> tuple[str, int]:
        data = bytes(data)
        if not self.limit:
            end = len(data) if final else data.rfind(b"\n") + 1
            text, _ = codecs.utf_8_decode(storable_escapes(data[:end]), errors, True)
            return text, end
        kept, start = [], 0
        while (newline := data.find(b"\n", start)) >= 0:
            kept.append(self._line(data[start : newline + 1]))
            start = newline + 1
        rest, end = data[start:], start
        if self.dropping or len(rest) > self.limit:
            kept.append(self._line(rest))
            end = len(data)
        elif final:
            kept.append(rest)
            end = len(data)
        text, _ = codecs.utf_8_decode(storable_escapes(b"".join(kept)), errors, True)
        return text, end

    def _line(self, line: bytes) -> bytes:
        """A line to decode, or the start of one (no newline yet): itself, `TOO_LARGE` once
        it is past the limit, nothing for the rest of one that was."""
        whole = line.endswith(b"\n")
        if self.dropping:
            self.dropping = not whole
            return b""
        if len(line) - whole <= self.limit:
            return line
        self.dropping = not whole
        return TOO_LARGE.encode() + b"\n"


STORABLE_UTF8 = "holdpoint_storable_utf8"
# What a line past the limit reads as: no JSON (a reader reports it as a line it could not
# parse, `holdpoint: ...` in its log), short enough to be quoted whole there.
TOO_LARGE = "holdpoint: answer past the response cap"


@functools.cache
def storable_encoding(limit: int = 0) -> str:
    """The name of a text encoding — UTF-8 whose decoding is `storable_escapes` line by line —
    for a reader that takes an encoding rather than bytes (the MCP SDK's stdio client). With
    a `limit`, a line longer than that many bytes decodes as the line `TOO_LARGE`: the reader
    never holds more of it (its own buffer keeps a line until its end comes). Registered
    with `codecs` on the first call for each limit."""
    name = STORABLE_UTF8 if not limit else f"{STORABLE_UTF8}_max_{limit}"
    utf8 = codecs.lookup("utf-8")
    decoder: type[_StorableLines] = (
        type("_CappedLines", (_StorableLines,), {"limit": limit}) if limit else _StorableLines
    )

    def decode(data: Any, errors: str = "strict") -> tuple[str, int]:
        return decoder(errors).decode(bytes(data), True), len(data)

    info = codecs.CodecInfo(
        name=name,
        encode=utf8.encode,
        decode=decode,
        incrementalencoder=utf8.incrementalencoder,
        incrementaldecoder=decoder,
    )
    codecs.register(lambda looked_up: info if looked_up == name else None)
    return name


_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def storable_text(text: str) -> str:
    """`text` with each NUL and each lone surrogate as U+FFFD: what a service said outside
    JSON (an answer kept in a last error, a client's name), as a text column takes it."""
    return _UNSTORABLE.sub("\ufffd", text)


def finite(value: Any) -> Any:
    """`value` with each NaN and ±Infinity as its text ("NaN", "Infinity", "-Infinity"), as
    an http tool's answer keeps them (runtime.outbound): no column nor the journal takes
    them, and JSON has no spelling for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [finite(item) for item in value]
    return value
