"""JSONPath (RFC 9535) for tool definitions: where a service's answer holds the external
id (`result.external_id`) or the effect found by a lookup (`lookup.found`).

A definition's expressions are compiled when it is saved, to refuse one that does not
parse, and then once per process per expression (cached), since every call of the tool
applies them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jsonpath_rfc9535


class JsonPathError(ValueError):
    """An expression that is not RFC 9535 JSONPath; the message suits a field error."""


@dataclass(frozen=True)
class JsonPath:
    expr: str
    query: jsonpath_rfc9535.JSONPathQuery

    def first(self, data: Any) -> Any | None:
        """The first node's value, or None when nothing matches."""
        try:
            node = self.query.find_one(data)
        except jsonpath_rfc9535.JSONPathError as exc:
            raise JsonPathError(f"{self.expr} could not be applied: {exc}") from None
        return None if node is None else node.value

    def values(self, data: Any) -> list[Any]:
        try:
            return list(self.query.find(data).values())
        except jsonpath_rfc9535.JSONPathError as exc:
            raise JsonPathError(f"{self.expr} could not be applied: {exc}") from None


@lru_cache(maxsize=1024)
def compile_path(expr: str) -> JsonPath:
    try:
        return JsonPath(expr, jsonpath_rfc9535.compile(expr))
    # RecursionError: nesting past the stack; OverflowError: a number past a double's range
    # (`1e400`), which the library reads as an integer through float.
    except (jsonpath_rfc9535.JSONPathError, RecursionError, OverflowError) as exc:
        raise JsonPathError(
            f"{expr!r} is not a JSONPath expression (RFC 9535, such as $.id or $[0].id): {exc}"
        ) from None
