"""JSONPath (RFC 9535) for tool definitions: where a service's answer holds the external
id (`result.external_id`) or the effect found by a lookup (`lookup.found`).

A definition's expressions are compiled when it is saved, to refuse one that does not
parse, and then once per process per expression (cached), since every call of the tool
applies them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jsonpath_rfc9535
import re2  # type: ignore[import-untyped]  # google-re2 ships no type information
from iregexp_check import check as is_iregexp
from jsonpath_rfc9535 import function_extensions


class JsonPathError(ValueError):
    """An expression that is not RFC 9535 JSONPath; the message suits a field error."""


@dataclass(frozen=True)
class JsonPath:
    expr: str
    query: jsonpath_rfc9535.JSONPathQuery

    def first(self, data: Any) -> Any | None:
        """The first node's value, or None when nothing matches. JsonPathError when the
        expression cannot be applied: that is no answer, never "nothing there"."""
        try:
            node = self.query.find_one(data)
        except (jsonpath_rfc9535.JSONPathError, Unmatchable) as exc:
            raise JsonPathError(f"{self.expr} could not be applied: {exc}") from None
        return None if node is None else node.value

    def values(self, data: Any) -> list[Any]:
        try:
            return list(self.query.find(data).values())
        except (jsonpath_rfc9535.JSONPathError, Unmatchable) as exc:
            raise JsonPathError(f"{self.expr} could not be applied: {exc}") from None

    def stopped_at(self, data: Any) -> tuple[int, list[Any]]:
        """Where the expression, matching nothing in `data`, stopped: the values its longest
        matching prefix selects, and that prefix's length in segments (0: not even its first
        segment matched; the values are then `[data]`). A lookup tells "nothing there" (an
        empty list, null) from "something there, but not where the path looks" by it."""
        segments = self.query.segments
        for length in range(len(segments) - 1, 0, -1):
            prefix = jsonpath_rfc9535.JSONPathQuery(env=_ENVIRONMENT, segments=segments[:length])
            try:
                values = list(prefix.find(data).values())
            except (jsonpath_rfc9535.JSONPathError, Unmatchable) as exc:
                raise JsonPathError(f"{self.expr} could not be applied: {exc}") from None
            if values:
                return length, values
        return 0, [data]

    def filters_at(self, index: int) -> bool:
        """Whether the expression's segment at `index` only filters (`[?…]`): where the
        match stopped before such a segment, the filter looked at what was there and chose
        nothing — the definition's own way of saying "none of these is it"."""
        segments = self.query.segments
        if not 0 <= index < len(segments):
            return False
        selectors = segments[index].selectors
        return bool(selectors) and all(
            isinstance(s, jsonpath_rfc9535.selectors.FilterSelector) for s in selectors
        )


class Unmatchable(Exception):
    """A string match() or search() cannot be run on (a lone surrogate: not UTF-8)."""


# match() and search() run on RE2, as approval conditions do (approvals/conditions.py): its
# time is linear in the string. The library runs them on `regex`, which backtracks: their
# patterns come from a tenant's definition or from the service's answer itself
# (`search(@.a, @.b)`), and `search(@, '(a|a)+$')` over 26 a's and a "!" took 15 s (each
# further "a" doubles it) on a worker other tenants' runs share. I-Regexp (RFC 9485), the
# patterns RFC 9535 takes, is made to map onto RE2: only `.` changes, to what I-Regexp
# means by it (any character but a line break; RE2's also takes \r).
@lru_cache(maxsize=512)
def _program(pattern: str) -> Any:
    options = re2.Options()
    options.log_errors = False
    parts: list[str] = []
    escaped = in_class = False
    for char in pattern:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == "[":
            in_class = True
        elif char == "]":
            in_class = False
        elif char == "." and not in_class:
            char = "[^\\n\\r]"
        parts.append(char)
    return re2.compile("".join(parts), options=options)


def _run(how: str, string: object, pattern: object) -> bool:
    """RFC 9535's match()/search(): false for a pattern that is not I-Regexp or a value
    that is not a string, as the library's."""
    if not isinstance(pattern, str) or not isinstance(string, str) or not is_iregexp(pattern):
        return False
    try:
        program = _program(pattern)
    except re2.error:
        return False
    try:
        return getattr(program, how)(string) is not None
    except UnicodeEncodeError:
        raise Unmatchable(f"{string[:40]!r} is not UTF-8 (a lone surrogate)") from None


class _Match(function_extensions.Match):
    def __call__(self, string: str, pattern: object) -> bool:
        return _run("fullmatch", string, pattern)


class _Search(function_extensions.Search):
    def __call__(self, string: str, pattern: object) -> bool:
        return _run("search", string, pattern)


class _Environment(jsonpath_rfc9535.JSONPathEnvironment):
    def setup_function_extensions(self) -> None:
        super().setup_function_extensions()
        self.function_extensions["match"] = _Match()
        self.function_extensions["search"] = _Search()


_ENVIRONMENT = _Environment()


# A descendant segment (`..`) visits every node below where it starts; one inside another's
# filter (`$..[?@..id]`) or after another (`$..a..id`) does so again for each node the first
# reached. Each more multiplies the work by the answer's size: over a 60 KB answer nested
# 55 deep, `$..[?@..[?@..x]]` took 4 s, and an answer may be 1 MB
# (HOLDPOINT_TOOL_MAX_RESPONSE_BYTES), read by a worker or an API thread other tenants share.
MAX_DESCENDANTS = 1
_STRING = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")


@lru_cache(maxsize=1024)
def compile_path(expr: str) -> JsonPath:
    descendants = _STRING.sub("", expr).count("..")
    if descendants > MAX_DESCENDANTS:
        raise JsonPathError(
            f"{expr!r} has {descendants} descendant segments (..): at most {MAX_DESCENDANTS},"
            " as each more multiplies the work by the size of the answer"
        )
    try:
        return JsonPath(expr, _ENVIRONMENT.compile(expr))
    # RecursionError: nesting past the stack; OverflowError: a number past a double's range
    # (`1e400`), which the library reads as an integer through float.
    except (jsonpath_rfc9535.JSONPathError, RecursionError, OverflowError) as exc:
        raise JsonPathError(
            f"{expr!r} is not a JSONPath expression (RFC 9535, such as $.id or $[0].id): {exc}"
        ) from None
