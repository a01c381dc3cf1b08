"""JSONPath (RFC 9535) as tool definitions use it: `result.external_id` and `lookup.found`."""

from __future__ import annotations

import threading
from collections.abc import Callable
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


def finishes(work: Callable[[], Any], seconds: float = 60) -> Any:
    """What `work` returned or raised, asserting it ended within `seconds` (a hang, not a
    speed: the bound is a thousand times what the work takes)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = work()
        except Exception as exc:
            box["value"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    return box["value"]


# `(a|a)+$` backtracks: against 26 a's and a "!" the library's search() took 15 s, and
# each further "a" doubles it. RE2 answers at once.
SLOW = "$[?search(@.title, '(a|a)+$')].id"
HOSTILE = [{"title": "a" * 60 + "!", "id": 1}, {"title": "a" * 60, "id": 2}]


@pytest.mark.parametrize(
    "expr", [SLOW, "$[?match(@.title, '(a|a)+')].id", "$[?search(@.title, @.pattern)].id"]
)
def test_a_regular_expression_that_would_backtrack_answers_at_once(expr: str) -> None:
    """The pattern may be the definition's or the answer's own (`@.pattern`)."""
    data = [{**item, "pattern": "(a|a)+$"} for item in HOSTILE]
    assert finishes(lambda: compile_path(expr).values(data)) == [2]
    assert finishes(lambda: compile_path(expr).first(data)) == 2


def test_match_and_search_keep_their_meaning() -> None:
    data = [
        {"title": "abc", "id": 1},
        {"title": "xabc", "id": 2},
        {"title": "a\nc", "id": 3},
        {"title": "a\rc", "id": 4},
        {"title": "aéc", "id": 5},
        {"title": ".c", "id": 6},
    ]
    assert compile_path("$[?match(@.title, 'a.c')].id").values(data) == [1, 5]
    assert compile_path("$[?search(@.title, 'a.c')].id").values(data) == [1, 2, 5]
    assert compile_path("$[?match(@.title, '[.]c')].id").values(data) == [6]
    assert compile_path("$[?match(@.title, '\\\\p{Ll}+')].id").values(data) == [1, 2, 5]
    assert compile_path("$[?search(@.title, 7)].id").values(data) == []  # no pattern
    assert compile_path("$[?search(@.title, '(?=a)')].id").values(data) == []  # no I-Regexp


def test_a_string_no_regular_expression_can_read_is_an_error_not_a_miss() -> None:
    """A lone surrogate (a service's `"\\ud800"`) is not UTF-8: "no match" there could
    read as "not found" and let an action be sent again."""
    with pytest.raises(JsonPathError, match="could not be applied"):
        compile_path(SLOW).values([{"title": "a\ud800", "id": 1}])


@pytest.mark.parametrize(
    "expr", ["$..[?@..id]", "$..a..id", "$[?@..a][?@..b]", "$..[?@..[?@..id]]"]
)
def test_a_descendant_segment_inside_or_after_another_is_refused(expr: str) -> None:
    """Each further `..` visits the whole answer again for every node the first reached:
    `$..[?@..[?@..x]]` took 4 s over a 60 KB answer, and an answer may be 1 MB."""
    with pytest.raises(JsonPathError, match="descendant segments"):
        compile_path(expr)


def test_one_descendant_segment_and_dots_in_strings_are_fine() -> None:
    data = {"a": [{"key": "x..y", "id": 4}], "id": 5}
    assert compile_path("$..id").values(data) == [5, 4]
    assert compile_path("$..[?@.key=='x..y'].id").values(data) == [4]
    assert compile_path('$.a[?@.key=="x..y"].id').values(data) == [4]
