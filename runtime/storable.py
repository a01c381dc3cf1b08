"""A service's JSON answer made storable, for every sender: http tools (runtime.outbound) and
MCP upstreams (runtime.mcp), over streamable HTTP or stdio.

An answer is the proof of an effect that happened: refusing to store it would leave that
effect unrecorded (a step failure, an action left `sent`, a person asked). Yet JSON brings
in what no column takes: a `\\u0000` escape (PostgreSQL's text and JSON refuse NUL), a lone
surrogate escape such as `\\ud800` (UTF-8 cannot hold it; the MCP SDK's parser refuses the
whole message for it), and, outside JSON proper, NaN and ±Infinity (which Python's parser
and pydantic's read). The escapes are rewritten in the answer's bytes, before any parser
sees them (for a stdio upstream, whose answers the SDK decodes itself, by the encoding
`storable_encoding` names); the numbers are kept as their text.
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
    `storable_escapes` first; a line's start is held until its end comes."""

    def _buffer_decode(self, data: Any, errors: str, final: bool) -> tuple[str, int]:
        end = len(data) if final else bytes(data).rfind(b"\n") + 1
        text, _ = codecs.utf_8_decode(storable_escapes(bytes(data[:end])), errors, True)
        return text, end


STORABLE_UTF8 = "holdpoint_storable_utf8"


@functools.cache
def storable_encoding() -> str:
    """The name of a text encoding — UTF-8 whose decoding is `storable_escapes` line by line —
    for a reader that takes an encoding rather than bytes (the MCP SDK's stdio client). It
    is registered with `codecs` on the first call."""
    utf8 = codecs.lookup("utf-8")

    def decode(data: Any, errors: str = "strict") -> tuple[str, int]:
        return _StorableLines(errors).decode(bytes(data), True), len(data)

    info = codecs.CodecInfo(
        name=STORABLE_UTF8,
        encode=utf8.encode,
        decode=decode,
        incrementalencoder=utf8.incrementalencoder,
        incrementaldecoder=_StorableLines,
    )
    codecs.register(lambda name: info if name == STORABLE_UTF8 else None)
    return STORABLE_UTF8


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
