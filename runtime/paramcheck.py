"""A tool's params schema, checked on every action before anything is prepared.

python-jsonschema (Draft 2020-12) is the authority: its verdict and its messages are what
a caller is told. It is also the slowest part of an action's dispatch for its size — 14 µs
for a three-field schema measured alone, 60–70 µs inside an action, where the interpreter's
caches are cold — while jsonschema-rs answers the same question in 0.2 µs. So a schema made
only of keywords both implement the same way (`FAST_KEYWORDS`: types, properties, required,
lengths, bounds, enums, the logic combinators; no patterns, formats, references or
`multipleOf`), and of numbers below 2**53 in magnitude, is asked of jsonschema-rs first.
Its "valid" is final; anything else — invalid, or a value it cannot take — is asked again
of python-jsonschema, whose answer stands. tests/runtime/test_paramcheck.py generates
schemas and values to find a value jsonschema-rs accepts and python-jsonschema refuses.

Where jsonschema-rs is the more lenient of the two it does not matter downstream: it takes
a tuple for an array (canonical JSON, which every action's params go through before they
are stored or sent, sends it as that array), an infinite number as within a bound
(canonical JSON refuses it: "NaN and Infinity are not JSON"), and compares a number beyond
2**53 inexactly (canonical JSON refuses it: "integer outside ±2**53").
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jsonschema
import jsonschema_rs
import referencing
import referencing.exceptions
from referencing.jsonschema import DRAFT202012

from audit.canonical import MAX_SAFE_INT, CanonicalError, canonical_bytes

if TYPE_CHECKING:
    from referencing._core import Resolver  # not exported by the package, only typed

# Keywords whose meaning jsonschema-rs and python-jsonschema implement identically for JSON
# values: those that hold subschemas, with how (one, a list, a map of them), and the rest.
_SUBSCHEMAS = {
    "properties": "map",
    "additionalProperties": "one",
    "items": "one",
    "prefixItems": "list",
    "allOf": "list",
    "anyOf": "list",
    "oneOf": "list",
    "not": "one",
    "if": "one",
    "then": "one",
    "else": "one",
}
_PLAIN = frozenset(
    {
        "type",
        "required",
        "minProperties",
        "maxProperties",
        "minItems",
        "maxItems",
        "enum",
        "const",
        "minLength",
        "maxLength",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        # annotations: no effect on validity
        "title",
        "description",
        "default",
        "examples",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
    }
)
FAST_KEYWORDS = frozenset(_SUBSCHEMAS) | _PLAIN


def fast_enough(schema: Any) -> bool:
    """Whether every keyword of `schema`, at every depth, is one of FAST_KEYWORDS."""
    if isinstance(schema, bool):
        return True
    if not isinstance(schema, dict):
        return False
    for keyword, value in schema.items():
        if keyword in _PLAIN:
            if not _exact(value):
                return False
            continue
        kind = _SUBSCHEMAS.get(keyword)
        if kind is None:
            return False
        if kind == "one":
            inner = [value]
        elif kind == "list" and isinstance(value, list):
            inner = value
        elif kind == "map" and isinstance(value, dict):
            inner = list(value.values())
        else:
            return False
        if not all(fast_enough(sub) for sub in inner):
            return False
    return True


def _exact(value: Any) -> bool:
    """Whether every number in `value` is within ±MAX_SAFE_INT (2**53 - 1), the numbers
    canonical JSON takes in params. Beyond it jsonschema-rs compares numbers inexactly where
    python-jsonschema does not (`exclusiveMinimum: 2**64` passed float(2**64), found by the
    property test); within it both compare the same values the same way."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return True
    if isinstance(value, int | float):
        return abs(value) <= MAX_SAFE_INT
    if isinstance(value, list):
        return all(_exact(item) for item in value)
    if isinstance(value, dict):
        return all(_exact(item) for item in value.values())
    return False


# Where a `$ref` may point: inside its own schema (jsonschema adds its metaschemas),
# never a URL. python-jsonschema's default fetches any other `$ref` with urllib when a
# value reaches it — from the API or a worker, to any host and address a tenant admin
# typed, past HOLDPOINT_TOOL_HOSTS and the private networks.
NOWHERE: referencing.Registry[Any] = referencing.Registry()


def unresolved_ref(schema: Any) -> str:
    """The first `$ref` (or `$dynamicRef`) of `schema` that does not point inside it, or ""
    when every one does: a tool whose schema has one could never check its params."""
    root = DRAFT202012.create_resource(schema)
    return _unresolved(NOWHERE.resolver_with_root(root), root)


def _unresolved(resolver: Resolver[Any], resource: referencing.Resource[Any]) -> str:
    if isinstance(resource.contents, Mapping):
        for keyword in ("$ref", "$dynamicRef"):
            ref = resource.contents.get(keyword)
            if not isinstance(ref, str):
                continue
            try:
                resolver.lookup(ref)
            except referencing.exceptions.Unresolvable:
                return ref
    for inner in resource.subresources():
        found = _unresolved(resolver.in_subresource(inner), inner)
        if found:
            return found
    return ""


# Keywords that apply their subschemas to the same value (not to a part of it): a `$ref`
# that comes back to itself through these alone never reaches into the params, and checking
# any value against it recurses until the stack runs out.
_IN_PLACE_ONE = ("not", "if", "then", "else")
_IN_PLACE_LIST = ("allOf", "anyOf", "oneOf")
_IN_PLACE_MAP = ("dependentSchemas",)


# The longest chain of `$ref`s (and in-place subschemas) a value is checked through: each
# step is a few frames of python-jsonschema's recursion, and a chain of some hundreds ran
# out of stack (a RecursionError at every action) though it never looped.
MAX_REF_CHAIN = 50


class RefChainTooLong(ValueError):
    """A schema whose `$ref`s chain further than MAX_REF_CHAIN (the message says so)."""


def looping_ref(schema: Any) -> str:
    """The first `$ref` (or `$dynamicRef`) of `schema` that leads back to a schema it came
    from without reaching into the value (`#/$defs/a` → `#/$defs/a`, or through `allOf`),
    or "" when none does. A `$ref` back to the root through `properties` or `items` is a
    tree of any depth, not a loop: each step goes one level into the params. Call it after
    `unresolved_ref` found nothing (a `$ref` it cannot resolve is skipped here).
    RefChainTooLong for a chain longer than MAX_REF_CHAIN that never loops."""
    root = DRAFT202012.create_resource(schema)
    done: set[int] = set()
    return _loop_in(NOWHERE.resolver_with_root(root), root, done)


def _loop_in(resolver: Resolver[Any], resource: referencing.Resource[Any], done: set[int]) -> str:
    found = _in_place_loop(resolver, resource.contents, [], done)
    if found:
        return found
    for inner in resource.subresources():
        found = _loop_in(resolver.in_subresource(inner), inner, done)
        if found:
            return found
    return ""


def _in_place_loop(resolver: Resolver[Any], contents: Any, path: list[int], done: set[int]) -> str:
    """Depth first over the subschemas `contents` applies to the same value; `path` holds
    the ones on the way here (a loop when one comes again), `done` those seen loop-free."""
    if not isinstance(contents, Mapping) or id(contents) in done:
        return ""
    if id(contents) in path:
        return "a loop"
    if len(path) >= MAX_REF_CHAIN:
        raise RefChainTooLong(
            f"its $refs chain more than {MAX_REF_CHAIN} deep without reaching into the params"
        )
    path.append(id(contents))
    nexts: list[tuple[Resolver[Any], Any, str]] = []
    for keyword in ("$ref", "$dynamicRef"):
        ref = contents.get(keyword)
        if isinstance(ref, str):
            try:
                resolved = resolver.lookup(ref)
            except referencing.exceptions.Unresolvable:
                continue
            nexts.append((resolved.resolver, resolved.contents, ref))
    inner: list[Any] = [contents.get(k) for k in _IN_PLACE_ONE]
    for keyword in _IN_PLACE_LIST:
        if isinstance(contents.get(keyword), list):
            inner.extend(contents[keyword])
    for keyword in _IN_PLACE_MAP:
        if isinstance(contents.get(keyword), Mapping):
            inner.extend(contents[keyword].values())
    for sub in inner:
        if isinstance(sub, Mapping):
            here = resolver.in_subresource(DRAFT202012.create_resource(sub))
            nexts.append((here, sub, ""))
    for next_resolver, next_contents, ref in nexts:
        found = _in_place_loop(next_resolver, next_contents, path, done)
        if found:
            return ref or found
    path.pop()
    done.add(id(contents))
    return ""


# Regular expressions in a schema (`pattern`, `patternProperties`) come from a tenant's
# admin or an upstream MCP server, and the strings they are run on from an agent. Python's
# `re`, which python-jsonschema uses, backtracks without bound: `^(a|a)+$` against forty
# a's and a "!" runs for days, on the API's thread or a worker's. jsonschema-rs runs them
# with Rust's linear-time engine, and the few ECMA-262 features that need backtracking
# (lookaround, backreferences) with a step limit; past it the string is refused
# ("Max limit for backtracking count exceeded") instead of hanging. So a schema with a
# regular expression anywhere is judged by jsonschema-rs alone, verdict and messages.
REGEX_KEYWORDS = frozenset({"pattern", "patternProperties"})
PATTERNS = jsonschema_rs.FancyRegexOptions(backtrack_limit=100_000)


def has_regex(schema: Any) -> bool:
    """Whether a regular-expression keyword appears anywhere in `schema`. It may also find
    a property so named (then jsonschema-rs judges a schema it did not need to: harmless)."""
    if isinstance(schema, dict):
        return any(k in REGEX_KEYWORDS or has_regex(v) for k, v in schema.items())
    if isinstance(schema, list):
        return any(has_regex(item) for item in schema)
    return False


def _refuse_retrieval(uri: str) -> Any:
    raise ValueError(f"{uri} is not fetched: a $ref must point inside the schema")


def regex_validator(schema: Any) -> Any:
    """jsonschema-rs for a schema with regular expressions, or ValueError saying why it
    cannot be built (a pattern it does not take, a `$ref` outside the schema)."""
    try:
        return jsonschema_rs.Draft202012Validator(
            schema,
            validate_formats=False,
            pattern_options=PATTERNS,
            retriever=_refuse_retrieval,
        )
    except Exception as exc:  # jsonschema_rs.ValidationError, ValueError: the schema
        raise ValueError(str(exc).split("\n", 1)[0]) from None


def ref_trouble(schema: Any) -> str:
    """Why `schema`'s `$ref`s make it unusable ("" when they do not): a definition is refused
    for it (runtime.tooldefs), and one stored before that checks no value against it."""
    try:
        loop = looping_ref(schema)
    except RefChainTooLong as exc:
        return str(exc)
    except Exception:  # not a schema the resolver can walk: the validators judge it
        return ""
    return f"$ref {loop!r} leads back to itself without reaching into the params" if loop else ""


class ParamsSchema:
    """One tool version's schema, its validators built once."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.full = jsonschema.Draft202012Validator(schema, registry=NOWHERE)
        self.fast: Any = None
        self.regex: Any = None
        # Stored before definitions were refused for it: checking any value would recurse
        # until the stack runs out (a RecursionError, or a panic inside the resolver's Rust
        # maps), so no value is checked against it.
        self.unusable = ref_trouble(schema)
        if self.unusable:
            return
        if has_regex(schema):
            try:
                self.regex = regex_validator(schema)
            except ValueError as exc:
                self.unusable = str(exc)
        elif fast_enough(schema):
            try:
                self.fast = jsonschema_rs.Draft202012Validator(schema, validate_formats=False)
            except Exception:  # a schema it will not build: the full check alone
                self.fast = None

    def errors(self, params: Any) -> dict[str, list[str]]:
        """Each place in `params` that does not fit (a dotted path, or "params") with its
        messages; empty when the params fit."""
        if self.unusable:
            return {"params": [f"the tool's schema cannot be used: {self.unusable}"]}
        if self.regex is not None:
            return _regex_errors(self.regex, params)
        if self.fast is not None:
            try:
                if self.fast.is_valid(params):
                    return {}
            except Exception:  # a value it cannot take (a lone surrogate, a key that is no
                pass  # string): the full check says
        errors: dict[str, list[str]] = {}
        try:
            for error in self.full.iter_errors(params):
                where = ".".join(str(p) for p in error.absolute_path) or "params"
                errors.setdefault(where, []).append(error.message)
        except referencing.exceptions.Unresolvable as exc:  # stored before `unresolved_ref`
            errors.setdefault("params", []).append(f"the tool's schema cannot be used: {exc}")
        return errors


def _regex_errors(validator: Any, params: Any) -> dict[str, list[str]]:
    """jsonschema-rs's verdict; never python-jsonschema's, whose `re` could hang on the
    same strings. A value jsonschema-rs cannot take (a lone surrogate) is one canonical JSON
    refuses as well, for every action: its reason is the answer."""
    try:
        found = list(validator.iter_errors(params))
    except Exception:
        try:
            as_json = json.loads(canonical_bytes(params))
        except CanonicalError as exc:
            return {exc.path if exc.path != "$" else "params": [str(exc)]}
        found = list(validator.iter_errors(as_json))
    errors: dict[str, list[str]] = {}
    for error in found:
        where = ".".join(str(p) for p in error.instance_path) or "params"
        errors.setdefault(where, []).append(error.message)
    return errors
