"""JSONPath (RFC 9535) as tool definitions use it: `result.external_id` and `lookup.found`."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.jsonpaths import JsonPathError, compile_path

ANSWER = {
    "id": "T-1",
    "items": [{"key": "a", "id": 1}, {"key": "k", "id": 2}, {"key": "k", "id": 3}],
}


@pytest.mark.parametrize(
    "expr, data, first, values",
    [
        ("$.id", ANSWER, "T-1", ["T-1"]),
        ("$[0].id", [{"id": 7}, {"id": 8}], 7, [7]),
        ("$.items[?@.key=='k'].id", ANSWER, 2, [2, 3]),
        ("$.items[*].id", ANSWER, 1, [1, 2, 3]),
        ("$.missing", ANSWER, None, []),
        ("$[0].id", [], None, []),  # a lookup that found nothing
        ("$.id", [1, 2], None, []),  # a name on an array selects nothing
        ("$['id']", ANSWER, "T-1", ["T-1"]),
    ],
)
def test_first_and_values(expr: str, data: Any, first: Any, values: list[Any]) -> None:
    path = compile_path(expr)
    assert path.first(data) == first
    assert path.values(data) == values


@pytest.mark.parametrize("expr", ["", "id", "$.", "$[", "$.items[?@.key=='k'", "$..", "$[?@.a=]"])
def test_an_expression_that_does_not_parse_is_refused(expr: str) -> None:
    with pytest.raises(JsonPathError, match="not a JSONPath expression"):
        compile_path(expr)


def test_not_rfc9535_dialects_are_refused() -> None:
    # jsonpath-ng and Goessner's draft accept these; RFC 9535 does not.
    for expr in ["$.items[?(@.key=='k')].id.`len`", "$.items[(@.length-1)]"]:
        with pytest.raises(JsonPathError):
            compile_path(expr)


def test_compiled_once() -> None:
    assert compile_path("$.items[0].id") is compile_path("$.items[0].id")
