"""A JSON parser that cannot be made to crash, mislead or overflow.

Stock DRF answers JSON nested 5,000 deep with a 500 (RecursionError), silently keeps the last
of duplicate keys, and accepts NaN/Infinity; PostgreSQL then refuses NUL characters late, as
a driver error. Here all of those are a 400 before anything is read by a view.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

from audit.canonical import MAX_DEPTH, CanonicalError, parse_strict


def _depth_ok(data: bytes) -> bool:
    """Nesting depth from the raw bytes, without recursion (strings skipped)."""
    depth, in_string, escaped = 0, False, False
    for byte in data:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            if depth > MAX_DEPTH:
                return False
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return True


class MalformedBody(ParseError):
    """A parse error that can say where: rendered with field `errors` like a 422."""

    def __init__(self, detail: str, errors: dict[str, list[str]]) -> None:
        super().__init__(detail)
        self.errors = errors


class StrictJSONParser(JSONParser):
    def parse(
        self,
        stream: Any,
        media_type: str | None = None,
        parser_context: Mapping[str, Any] | None = None,
    ) -> Any:
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE or 2_621_440
        data = stream.read(limit + 1) if stream is not None else b""
        if len(data) > limit:
            raise ParseError(f"request body larger than {limit} bytes")
        if not data:
            return {}
        if not _depth_ok(data):
            raise ParseError(f"JSON nested deeper than {MAX_DEPTH} levels")
        try:
            return parse_strict(data.decode("utf-8"))
        except UnicodeDecodeError:
            raise ParseError("request body is not UTF-8") from None
        except CanonicalError as exc:
            raise MalformedBody(f"JSON parse error: {exc}", {exc.path: [str(exc)]}) from None
