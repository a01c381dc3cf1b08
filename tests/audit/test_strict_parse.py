"""audit.canonical.parse_strict — how every entry point parses JSON — refuses what it cannot
take with CanonicalError, nesting included: Python's own parser answers deep input with
RecursionError, which no caller expected (the run page's forms answered it with a 500)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from audit.canonical import MAX_DEPTH, CanonicalError, deeper_than, parse_strict


def _arrays(depth: int) -> str:
    return "[" * depth + "]" * depth


def _objects(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


@pytest.mark.parametrize("nest", [_arrays, _objects])
def test_as_deep_as_the_limit_is_read(nest: object) -> None:
    assert parse_strict(nest(MAX_DEPTH)) is not None  # type: ignore[operator]


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 900, 5_000, 100_000, 1_000_000])
@pytest.mark.parametrize("nest", [_arrays, _objects])
def test_deeper_is_refused_as_bad_json_not_a_recursion_error(nest: object, depth: int) -> None:
    with pytest.raises(CanonicalError, match=f"nested deeper than {MAX_DEPTH} levels"):
        parse_strict(nest(depth))  # type: ignore[operator]


def test_depth_counts_objects_and_arrays_together() -> None:
    mixed = '{"a":[' * (MAX_DEPTH // 2) + "1" + "]}" * (MAX_DEPTH // 2)
    assert parse_strict(mixed) is not None
    with pytest.raises(CanonicalError):
        parse_strict("[" + mixed + "]")


def test_a_reviewer_s_json_field_edit_nested_too_deep_is_a_field_error() -> None:
    """approvals.forms reads a reviewer's edit of a JSON-valued param with parse_strict:
    deep JSON is that field's error, with the draft kept (it was a 500)."""
    from django.http import QueryDict

    from approvals.forms import edits_from
    from runtime.errors import InvalidParams

    shown = {
        "tool": "t.unknown",
        "schema": {"type": "object", "properties": {"labels": {"type": "array"}}},
        "editable": ["labels"],
    }
    post = QueryDict(mutable=True)
    post["param-labels"] = "[" * 5_000 + "]" * 5_000
    with pytest.raises(InvalidParams) as refused:
        edits_from(post, shown, {"labels": ["a"]})
    message = f"labels is not valid JSON: JSON nested deeper than {MAX_DEPTH} levels"
    assert refused.value.extra["errors"] == {"labels": [message]}
    assert refused.value.extra["drafts"]["labels"] == post["param-labels"]


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=3),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=2), inner, max_size=3)
    ),
    max_leaves=30,
)


def _nesting(value: object) -> int:
    """Levels of objects and arrays, by the definition (recursion: these are small)."""
    if isinstance(value, dict):
        return 1 + max(map(_nesting, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_nesting, value), default=0)
    return 0


@given(JSON, st.integers(min_value=0, max_value=6))
def test_deeper_than_counts_levels_of_objects_and_arrays(value: object, limit: int) -> None:
    assert deeper_than(value, limit) == (_nesting(value) > limit)
