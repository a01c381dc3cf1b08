"""A tool's params are judged as python-jsonschema alone judges them, though jsonschema-rs
answers first where it can (runtime.paramcheck): generated schemas and values look for one
it accepts that python-jsonschema refuses, and the messages a caller gets are compared."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from runtime.actionkeys import canonical_params
from runtime.errors import InvalidParams
from runtime.paramcheck import (
    FAST_KEYWORDS,
    ParamsSchema,
    RefChainTooLong,
    fast_enough,
    looping_ref,
)
from runtime.tooldefs import InvalidTool, parse
from runtime.tools import Tool

# Numbers at and around the bounds below, where two implementations' arithmetic can part.
EDGES = [0, 1, -1, 0.5, 1.0, 1.5, -1.5, 2.0, -0.0, 3, -3, 2**53 - 1, 2**53, 2**53 + 1]
EDGES += [float(2**53), -(2**53) - 1, 2**63, 2**64, 2**64 + 1, float(2**64), 1e300]
NAMES = st.sampled_from(["a", "b", "title", "n", "é"])
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.integers(min_value=-5, max_value=5)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(EDGES)
    | st.text(max_size=6)
)
JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(NAMES | st.text(max_size=3), inner, max_size=4)
    ),
    max_leaves=12,
)
SMALL = st.integers(min_value=0, max_value=4)
BOUND = st.integers(min_value=-3, max_value=3) | st.sampled_from(
    [0.5, -1.5, 2**53 - 1, -(2**53 - 1), 2.0**52 + 0.5, 2**53, 2**64, float(2**64), 1e300]
)
TYPES = st.sampled_from(["null", "boolean", "integer", "number", "string", "array", "object"])


def _leaf() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {},
        optional={
            "type": TYPES | st.lists(TYPES, min_size=1, max_size=3, unique=True),
            "minLength": SMALL,
            "maxLength": SMALL,
            "minimum": BOUND,
            "maximum": BOUND,
            "exclusiveMinimum": BOUND,
            "exclusiveMaximum": BOUND,
            "enum": st.lists(JSON, min_size=1, max_size=3),
            "const": JSON,
            "required": st.lists(NAMES, max_size=3, unique=True),
            "minProperties": SMALL,
            "maxProperties": SMALL,
            "minItems": SMALL,
            "maxItems": SMALL,
            "description": st.text(max_size=5),
        },
    )


def _composed(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    some = st.lists(inner, min_size=1, max_size=3)
    return st.fixed_dictionaries(
        {},
        optional={
            "type": TYPES,
            "properties": st.dictionaries(NAMES, inner, max_size=3),
            "additionalProperties": inner,
            "items": inner,
            "prefixItems": some,
            "allOf": some,
            "anyOf": some,
            "oneOf": some,
            "not": inner,
            "if": inner,
            "then": inner,
            "else": inner,
            "required": st.lists(NAMES, max_size=3, unique=True),
        },
    )


SCHEMAS = st.recursive(st.booleans() | _leaf(), _composed, max_leaves=8)


def _constants(schema: Any, numbers: list[Any], names: list[str], values: list[Any]) -> None:
    """What a schema names — bounds, lengths, enum members, constants, property names — so
    that values are drawn at and around them, where implementations part."""
    if not isinstance(schema, dict):
        return
    for keyword, value in schema.items():
        if keyword in ("enum",):
            values.extend(value)
        elif keyword == "const":
            values.append(value)
        elif keyword == "required":
            names.extend(value)
        elif keyword == "properties":
            names.extend(value)
            for sub in value.values():
                _constants(sub, numbers, names, values)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            numbers.append(value)
        elif isinstance(value, dict):
            _constants(value, numbers, names, values)
        elif isinstance(value, list):
            for sub in value:
                _constants(sub, numbers, names, values)


@st.composite
def schema_and_value(draw: st.DrawFn) -> tuple[Any, Any]:
    schema = draw(SCHEMAS)
    numbers: list[Any] = []
    names: list[str] = []
    values: list[Any] = []
    _constants(schema, numbers, names, values)
    near = [
        x
        for n in numbers
        for x in (n, n + 1, n - 1, n + 0.5, n - 0.5, float(n), -n, "a" * min(int(abs(n)), 9))
    ]
    scalars = st.sampled_from(near + values + EDGES) | SCALARS
    keys = st.sampled_from(names) | NAMES if names else NAMES
    value = draw(
        st.recursive(
            scalars,
            lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
            max_leaves=12,
        )
    )
    return schema, value


@st.composite
def bound_and_scalar(draw: st.DrawFn) -> tuple[Any, Any]:
    """One level of keywords and a value at or around what they name: where two
    implementations' arithmetic, types and lengths part, searched densely."""
    schema = draw(_leaf())
    numbers: list[Any] = []
    _constants(schema, numbers, [], [])
    near = [
        x
        for n in numbers
        for x in (n, n + 1, n - 1, n + 0.5, float(n), -n, "é" * min(int(abs(n)), 9))
    ]
    return schema, draw(st.sampled_from(near + EDGES) | SCALARS)


def python_only(schema: Any, value: Any) -> dict[str, list[str]]:
    errors: dict[str, list[str]] = {}
    for error in jsonschema.Draft202012Validator(schema).iter_errors(value):
        where = ".".join(str(p) for p in error.absolute_path) or "params"
        errors.setdefault(where, []).append(error.message)
    return errors


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=schema_and_value())
def test_the_fast_answer_never_differs_from_python_jsonschema(case: tuple[Any, Any]) -> None:
    schema, value = case
    checked = ParamsSchema(schema)
    assert (checked.fast is not None) == fast_enough(schema)
    assert checked.errors(value) == python_only(schema, value)


@settings(max_examples=600, deadline=None)
@given(case=bound_and_scalar())
@example(case=({"exclusiveMinimum": 2**64}, float(2**64)))  # found by this test
@example(case=({"maximum": 2**53 - 1}, 2**53 + 1))
@example(case=({"minimum": -(2**53 - 1)}, -(2**53 + 1)))
def test_the_fast_answer_agrees_at_the_bounds(case: tuple[Any, Any]) -> None:
    schema, value = case
    assert ParamsSchema(schema).errors(value) == python_only(schema, value)


@settings(max_examples=300, deadline=None)
@given(
    value=st.dictionaries(NAMES, JSON, max_size=4),
    title=st.text(max_size=300),
)
def test_a_built_in_shaped_schema_agrees_on_objects(value: dict[str, Any], title: str) -> None:
    schema = {
        "type": "object",
        "properties": {
            "title": {"type": "string", "minLength": 1, "maxLength": 200},
            "body": {"type": "string", "maxLength": 20000},
        },
        "required": ["title"],
        "additionalProperties": False,
    }
    checked = ParamsSchema(schema)
    assert checked.fast is not None
    for params in (value, {**value, "title": title}, {"title": title}):
        assert checked.errors(params) == python_only(schema, params)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "format": "email"},
        {"$ref": "#/$defs/x", "$defs": {"x": {"type": "string"}}},
        {"type": "number", "multipleOf": 0.1},
        {"type": "array", "uniqueItems": True},
        {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object"},
        {"anyOf": [{"type": "string"}, {"format": "date"}]},
        {"properties": "not a map"},
    ],
)
def test_keywords_outside_the_shared_set_are_judged_by_python_jsonschema_alone(
    schema: dict[str, Any],
) -> None:
    assert not fast_enough(schema)
    assert ParamsSchema(schema).fast is None


@pytest.mark.parametrize(
    ("schema", "fast"),
    [
        ({"maximum": 2**53 - 1}, True),
        ({"minimum": -(2.0**52)}, True),
        ({"maximum": 2**53}, False),
        ({"exclusiveMinimum": 2**64}, False),
        ({"properties": {"n": {"enum": [1, [2**60]]}}}, False),
        ({"const": {"n": 1e300}}, False),
    ],
)
def test_numbers_past_2_53_are_judged_by_python_jsonschema_alone(schema: Any, fast: bool) -> None:
    """Past 2**53 jsonschema-rs compares numbers inexactly: {"exclusiveMinimum": 2**64}
    passed float(2**64), which python-jsonschema refuses (the bounds test found it)."""
    assert fast_enough(schema) is fast
    assert ParamsSchema(schema).errors(float(2**64)) == python_only(schema, float(2**64))


def test_the_shared_set_is_what_the_fast_path_names() -> None:
    assert {"pattern", "format", "$ref", "multipleOf", "uniqueItems"}.isdisjoint(FAST_KEYWORDS)


def test_values_the_fast_validator_cannot_take_are_judged_by_python_jsonschema() -> None:
    checked = ParamsSchema({"type": "object", "properties": {"a": {"maxLength": 1}}})
    assert checked.fast is not None
    # A lone surrogate (jsonschema-rs cannot encode it) and a key that is no string.
    assert checked.errors({"a": "\ud800x"}) == {"a": ["'\\ud800x' is too long"]}
    assert checked.errors({1: "x"}) == python_only(checked.full.schema, {1: "x"}) == {}


def test_where_the_fast_validator_is_more_lenient_canonical_json_decides() -> None:
    """A tuple passes as the array canonical JSON sends; an infinity passes a bound and
    canonical JSON, which every action's params go through, refuses it."""
    tool = Tool(
        name="t.lenient",
        schema={"type": "object", "properties": {"xs": {"type": "array"}, "n": {"maximum": 1}}},
    )
    tool.validate({"xs": (1, 2)})
    assert canonical_params({"xs": (1, 2)}).text == '{"xs":[1,2]}'
    tool.validate({"n": math.inf})
    with pytest.raises(InvalidParams, match="NaN and Infinity are not JSON"):
        canonical_params({"n": math.inf})
    with pytest.raises(InvalidParams) as refused:
        tool.validate({"n": 2, "xs": "no"})
    assert refused.value.extra["errors"] == {
        "n": ["2 is greater than the maximum of 1"],
        "xs": ["'no' is not of type 'array'"],
    }


REGEX_SCHEMA = {
    "type": "object",
    "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]+$"}},
    "patternProperties": {"^x-": {"type": "integer"}},
}


def test_a_schema_with_regular_expressions_is_judged_by_jsonschema_rs() -> None:
    """python-jsonschema's `re` backtracks without bound; jsonschema-rs's engine does not
    (tests/runtime/test_tool_definitions.py has the hang). Its verdicts agree here."""
    checked = ParamsSchema(REGEX_SCHEMA)
    assert checked.regex is not None and checked.fast is None
    for params in (
        {"code": "ABC-12", "x-a": 1},
        {"code": "abc-12"},
        {"code": "ABC-12\n"},  # Python's `$` matches before a final newline; ECMA's does not
        {"x-a": "one", "y": "two"},
        {"code": 7},
    ):
        verdict = checked.errors(params)
        assert bool(verdict) == (params != {"code": "ABC-12", "x-a": 1}), (params, verdict)
    assert checked.errors({"code": "abc", "x-b": "s"}) == {
        "code": ['"abc" does not match "^[A-Z]{3}-[0-9]+$"'],
        "x-b": ['"s" is not of type "integer"'],
    }


def test_a_value_jsonschema_rs_cannot_take_gets_canonical_jsons_reason() -> None:
    """Never python-jsonschema's `re` in its place: the string could be the hostile one."""
    checked = ParamsSchema(REGEX_SCHEMA)
    assert checked.errors({"code": "\ud800", "x-a": 1}) == {
        "code": [".code: lone surrogate in string"]
    }
    assert checked.errors(({"code": "ABC-1"},)) != {}  # not an object, said by jsonschema-rs


def test_a_stored_schema_whose_pattern_cannot_run_refuses_every_action() -> None:
    """Defined before `tooldefs` refused it: every action is refused, saying why."""
    checked = ParamsSchema({"type": "object", "properties": {"a": {"pattern": "x\\Z"}}})
    assert checked.errors({"a": "x"}) == {
        "params": ['the tool\'s schema cannot be used: "x\\\\Z" is not a "regex"']
    }


def test_a_pattern_that_backtracks_is_refused_at_once_not_run_for_ever() -> None:
    """python-jsonschema's `re` ran `^(a|a)+$` over sixty a's and a "!" for ever (without
    releasing the GIL, so the check runs in a process of its own here, stopped at 60 s)."""
    schema = {"type": "object", "properties": {"title": {"pattern": "^(a|a)+$"}}}
    params = {"title": "a" * 60 + "!"}
    code = (
        "import json, sys; from runtime.paramcheck import ParamsSchema; "
        "print(json.dumps(ParamsSchema(json.loads(sys.argv[1])).errors(json.loads(sys.argv[2]))))"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, json.dumps(schema), json.dumps(params)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
            cwd=Path(__file__).resolve().parents[2],
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the params check still ran after 60 s")
    assert json.loads(done.stdout) == {"title": ['"' + "a" * 60 + '!" does not match "^(a|a)+$"']}


_LOOPS = {
    "through an anchor and not": {
        "$defs": {"a": {"$anchor": "A", "not": {"$ref": "#A"}}},
        "properties": {"x": {"$ref": "#A"}},
    },
    "through an $id": {
        "$defs": {"a": {"$id": "https://e.example/a", "$ref": "a"}},
        "properties": {"x": {"$ref": "https://e.example/a"}},
    },
    "through a $dynamicRef": {
        "$defs": {"a": {"$dynamicAnchor": "d", "anyOf": [{"$dynamicRef": "#d"}]}},
        "properties": {"x": {"$ref": "#/$defs/a"}},
    },
    "the root through allOf": {"allOf": [{"$ref": "#"}]},
}
_TREES = {  # (schema, params it takes)
    "a child of its own kind": ({"properties": {"c": {"$ref": "#"}}}, {"c": {"c": {}}}),
    "a list of its own kind": (
        {"properties": {"c": {"type": "array", "items": {"$ref": "#"}}}},
        {"c": [{"c": []}]},
    ),
    "one definition used twice": (
        {
            "$defs": {
                "a": {"allOf": [{"$ref": "#/$defs/b"}, {"$ref": "#/$defs/b"}]},
                "b": {"type": "string"},
            },
            "properties": {"x": {"$ref": "#/$defs/a"}},
        },
        {"x": "1"},
    ),
}


@pytest.mark.parametrize("schema", list(_LOOPS.values()), ids=list(_LOOPS))
def test_a_ref_loop_is_found_and_refuses_params_instead_of_recursing(schema: Any) -> None:
    """Checking any value against such a schema recursed until the stack ran out."""
    schema = {"type": "object", **schema}
    assert looping_ref(schema)
    assert "leads back to itself" in ParamsSchema(schema).errors({"x": "1"})["params"][0]


@pytest.mark.parametrize(("schema", "params"), list(_TREES.values()), ids=list(_TREES))
def test_a_ref_that_reaches_into_the_value_is_no_loop(schema: Any, params: Any) -> None:
    schema = {"type": "object", **schema}
    assert looping_ref(schema) == ""
    assert ParamsSchema(schema).errors(params) == {}


def test_a_long_ref_chain_is_refused_instead_of_running_out_of_stack() -> None:
    """No loop, but each `$ref` is a few frames of python-jsonschema's recursion: a chain of
    1,500 raised RecursionError at every action (and when the definition was checked)."""
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(1500)}
    defs["d1500"] = {"type": "string"}
    schema = {"type": "object", "$defs": defs, "properties": {"x": {"$ref": "#/$defs/d0"}}}
    with pytest.raises(RefChainTooLong):
        looping_ref(schema)
    assert "chain" in ParamsSchema(schema).errors({"x": "a"})["params"][0]
    with pytest.raises(InvalidTool) as refused:
        parse({"name": "t.x", "effect": "read", "executor": "client", "schema": schema})
    assert "chain" in refused.value.extra["errors"]["schema"][0]
