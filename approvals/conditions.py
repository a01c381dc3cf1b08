"""The condition language of approval policies: what it may say, and whether it holds.

A policy's condition narrows which actions of its tool wait for a person:

- empty (`None` or `{}`): every action of the tool;
- `{"target_matches": PATTERN}`: the action's target matches the regular expression;
- `{"param": NAME, "op": OP, "value": V}`: the action's top-level param NAME compared with
  V by OP (`eq`, `ne`, `gt`, `gte`, `lt`, `lte`, `contains`, `matches`; `eq` by default).

Two rules shape this module:

- **Fail closed.** The condition is the only thing between an action and "no person looks
  at it", so a condition that cannot be evaluated — a param the action does not have, a
  value of the wrong type for the operator, an unknown operator or shape, a pattern the
  engine cannot run — *holds* the action. Only a condition that evaluates and says no lets
  it go without approval.
- **Linear time.** Patterns come from tenant admins and run on agent-supplied text at every
  prepare, in a shared worker: a backtracking engine lets `^(a+)+$` stall it for minutes
  (issue 16 L5). Patterns run on RE2 (`google-re2`), whose matching is linear in the input;
  RE2 refuses what it cannot run in linear time (backreferences, lookaround), and `check`
  refuses such a pattern when the policy is saved.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import re2  # type: ignore[import-untyped]  # google-re2 ships no type information

from audit.canonical import CanonicalError, canonical_bytes

OPS = ("eq", "ne", "gt", "gte", "lt", "lte", "contains", "matches")
ORDERING = {
    "gt": lambda a, b: a > b,
    "gte": lambda a, b: a >= b,
    "lt": lambda a, b: a < b,
    "lte": lambda a, b: a <= b,
}
# Patterns longer than this are refused: RE2 is linear in the input, but compiling a huge
# pattern still costs memory in every worker.
MAX_PATTERN = 1000


class Unevaluable(Exception):
    """The condition cannot say yes or no about this action: it holds it (fail closed)."""


def _options() -> re2.Options:
    options = re2.Options()
    options.log_errors = False  # a refused pattern is our error to report, not stderr noise
    return options


@functools.lru_cache(maxsize=256)
def compile_pattern(pattern: str) -> Any:
    """The RE2 program for a pattern (cached: the same policies are read at every prepare).

    Raises `re2.error` for a pattern RE2 cannot run."""
    if len(pattern) > MAX_PATTERN:
        raise re2.error(f"longer than {MAX_PATTERN} characters")
    return re2.compile(pattern, options=_options())


def _search(pattern: Any, text: Any) -> bool:
    if not isinstance(pattern, str) or not isinstance(text, str):
        raise Unevaluable("a pattern and the text it is matched on must be strings")
    try:
        return compile_pattern(pattern).search(text) is not None
    except re2.error as exc:
        raise Unevaluable(f"pattern refused by RE2: {_message(exc)}") from None


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _same(a: Any, b: Any) -> bool:
    """JSON equality: `true` is not `1`, `1` is `1.0` — as the action hash sees params."""
    try:
        return canonical_bytes(a) == canonical_bytes(b)
    except CanonicalError:
        raise Unevaluable("not JSON values") from None


def _compare(op: str, value: Any, expected: Any) -> bool:
    if op == "eq":
        return _same(value, expected)
    if op == "ne":
        return not _same(value, expected)
    if op in ORDERING:
        if not (_number(value) and _number(expected)):
            raise Unevaluable(f"{op} compares numbers")
        return bool(ORDERING[op](value, expected))
    if op == "contains":
        if isinstance(value, str) and isinstance(expected, str):
            return expected in value
        if isinstance(value, list):
            return any(_same(item, expected) for item in value)
        raise Unevaluable("contains needs a string or a list")
    if op == "matches":
        return _search(expected, value)
    raise Unevaluable(f"unknown op {op!r}")


def evaluate(condition: Any, params: dict[str, Any], target: str) -> bool:
    """Whether the condition holds the action; raises Unevaluable when it cannot tell."""
    if condition in (None, {}):
        return True
    if not isinstance(condition, dict):
        raise Unevaluable("a condition is an object")
    if set(condition) == {"target_matches"}:
        return _search(condition["target_matches"], target)
    if "param" not in condition or not set(condition) <= {"param", "op", "value"}:
        raise Unevaluable('needs "param" (with "op" and "value") or only "target_matches"')
    name = condition["param"]
    if not isinstance(name, str) or name not in params:
        raise Unevaluable(f"the action has no param {name!r}")
    return _compare(str(condition.get("op", "eq")), params[name], condition.get("value"))


def holds(condition: Any, params: dict[str, Any], target: str) -> bool:
    """Whether the action waits for a person under this condition. Fail closed: a condition
    that cannot be evaluated holds the action rather than lets it go."""
    try:
        return evaluate(condition, params, target)
    except Unevaluable:
        return True


def exempts(condition: Any, params: dict[str, Any], target: str) -> bool:
    """Whether an exemption (a policy with `required=False`) lets the action go without a
    person. Fail closed the other way round: only a condition that evaluates and says yes
    exempts; one that cannot be evaluated does not."""
    try:
        return evaluate(condition, params, target)
    except Unevaluable:
        return False


def _message(exc: Exception) -> str:
    text = exc.args[0] if exc.args else str(exc)
    return text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text)


ALWAYS = "(always)"
# The admin's help for the field: the whole language, with an example of each shape.
HELP = (
    "Which actions of the tool wait for a person. Empty: every action "
    + ALWAYS
    + '. A param compared with a value: {"param": "amount", "op": "gt", "value": 100} '
    + f"(op: {', '.join(OPS)}; eq if left out). The action's target matched by a pattern: "
    + '{"target_matches": "^prod-"} (RE2 syntax). A condition that cannot be evaluated '
    + "for an action (a missing param, a value of the wrong type) holds that action."
)


def describe(condition: Any) -> str:
    """A condition in a few words for lists: `(always)`, `amount gt 100`,
    `target matches ^prod-`; anything else as its JSON."""
    if condition in (None, {}):
        return ALWAYS
    if isinstance(condition, dict) and not check(condition):
        if "target_matches" in condition:
            return f"target matches {condition['target_matches']}"
        value = json.dumps(condition.get("value"), ensure_ascii=False)
        return f"{condition['param']} {condition.get('op', 'eq')} {value}"
    return json.dumps(condition, ensure_ascii=False, default=str)


def check(condition: Any) -> str:
    """What is wrong with a condition a tenant admin wants to save ("" when nothing is).

    The same shape `evaluate` reads; a pattern must compile on RE2."""
    if condition in (None, {}):
        return ""
    if not isinstance(condition, dict):
        return 'an object, e.g. {"param": "amount", "op": "gt", "value": 100}'
    if _has_nul(condition):
        # PostgreSQL's JSONB cannot hold one (a 500 when saved); no param name, value or
        # pattern needs one. Refused alike on SQLite, which would store it.
        return "a NUL character (\\u0000) cannot be stored in a condition"
    if "target_matches" in condition:
        if set(condition) != {"target_matches"}:
            return '"target_matches" stands alone (no "param", "op" or "value" beside it)'
        return _pattern_problem(condition["target_matches"])
    if "param" not in condition:
        return 'needs "param" (with "op" and "value") or "target_matches"'
    extra = sorted(set(condition) - {"param", "op", "value"})
    if extra:
        return f"unknown keys: {', '.join(extra)}"
    if not isinstance(condition["param"], str) or not condition["param"]:
        return '"param" is the name of one of the tool\'s params'
    op = condition.get("op", "eq")
    if op not in OPS:
        return f"op must be one of {', '.join(OPS)}"
    value = condition.get("value")
    if op in ORDERING and not _number(value):
        return f"{op} compares numbers: value must be a number"
    if op == "contains" and value is None:
        return "contains needs a value"
    if op == "matches":
        return _pattern_problem(value)
    return ""


def _has_nul(value: Any) -> bool:
    """Whether a NUL is anywhere in a JSON value: a string, a key, or nested."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    return False


def _pattern_problem(pattern: Any) -> str:
    if not isinstance(pattern, str):
        return "the pattern must be a string"
    try:
        compile_pattern(pattern)
    except re2.error as exc:
        return (
            f"RE2 cannot run this regular expression ({_message(exc)}); patterns run in "
            "linear time, so backreferences and lookaround are not available"
        )
    return ""
