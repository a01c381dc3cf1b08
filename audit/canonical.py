"""Canonical JSON bytes (RFC 8785 style) for hashing.

Hashes must cover exactly the bytes that are stored, and the same value must always give the
same bytes: keys sorted, no insignificant white space, UTF-8, and no NaN/Infinity (which JSON
does not define and parsers disagree on). Numbers are limited to what survives a round trip
through every JSON parser the product meets: integers within ±2**53, finite floats.

`canonical_bytes` is the definition; `canonical` gives the same bytes several times faster
for the values hashed on every durable step, and falls back to the definition for the rest.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable
from typing import Any

MAX_SAFE_INT = 2**53 - 1


class CanonicalError(ValueError):
    """The value cannot be canonicalised without ambiguity.

    `path` names where (`goal.items[2]`, `$` for the whole value) so an API can answer with a
    field error rather than only a sentence.
    """

    path: str = "$"


def _at(path: str, reason: str) -> CanonicalError:
    error = CanonicalError(f"{path or '$'}: {reason}")
    error.path = path.lstrip(".") or "$"
    return error


def _check(value: Any, path: str) -> None:
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int):
        if abs(value) > MAX_SAFE_INT:
            raise _at(path, "integer outside ±2**53")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _at(path, "NaN and Infinity are not JSON")
        if abs(value) > MAX_SAFE_INT:
            # Every float this large is a whole number that some stores (PostgreSQL JSONB)
            # turn into an integer beyond ±2**53: refuse it like such an integer.
            raise _at(path, "number outside ±2**53")
        return
    if isinstance(value, str):
        if "\x00" in value:
            raise _at(path, "NUL characters are not allowed")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise _at(path, "lone surrogate in string") from None
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise _at(path, "object keys must be strings")
            _check(key, path)
            _check(item, f"{path}.{key}")
        return
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _check(item, f"{path}[{index}]")
        return
    raise _at(path, f"{type(value).__name__} is not a JSON value")


def _normalise(value: Any) -> Any:
    """ECMAScript number form: 1.0 and -0.0 are written as 1 and 0, as RFC 8785 does."""
    if isinstance(value, float) and value.is_integer() and abs(value) <= MAX_SAFE_INT:
        return int(value)
    if isinstance(value, dict):
        return {key: _normalise(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_normalise(item) for item in value]
    return value


def canonical_bytes(value: Any) -> bytes:
    """The one byte form of a JSON value that hashes and storage agree on."""
    _check(value, "")
    return json.dumps(
        _normalise(value),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    ).encode("utf-8")


# --- the same bytes, fast, for what is hashed on every step --------------------------------
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
# How json escapes a string with ensure_ascii off (the C function when there is one).
_ESCAPE = json.encoder.encode_basestring
# CPython's private C accelerator, which typeshed does not declare.
_C_MAKE_ENCODER: Callable[..., Callable[[Any, int], Iterable[str]]] | None = getattr(
    json.encoder, "c_make_encoder", None
)
if _C_MAKE_ENCODER is not None:
    # `_ENCODER.encode`, minus what each call of it sets up again: the C encoder it builds per
    # call, built once. Same arguments, but no circular-reference markers: it only encodes
    # values `_plain` accepted — and `_plain` never returns for a value that contains itself.
    _ONE_SHOT = _C_MAKE_ENCODER(None, _ENCODER.default, _ESCAPE, None, ":", ",", True, False, True)

    def _encode(value: Any, /) -> str:
        return "".join(_ONE_SHOT(value, 0))
else:  # pragma: no cover - CPython always has the C encoder
    _encode = _ENCODER.encode


def canonical(value: Any) -> bytes:
    """`canonical_bytes(value)`, byte for byte, at a fraction of its cost for what is hashed
    on every step (journal entries, checkpoints, artifacts): values with no float. Such a
    value needs no normalisation, so once it passes the same checks — string keys, no NUL, no
    lone surrogate, integers within ±2**53 — the same `json.dumps` gives the same bytes.
    Anything else (a float, a value that fails a check) goes to `canonical_bytes` itself,
    which normalises it or refuses it with the precise reason."""
    if _plain(value):
        try:
            return _encode(value).encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: let canonical_bytes say where
            pass
    return canonical_bytes(value)


def _plain(value: Any) -> bool:
    """`_plain_any(value)`, with the common case — an object of str/int/None values, as every
    step hashes several of — checked in one loop instead of one call per value. Only values
    of exactly these classes take the shortcut; anything else (a str or int subclass, a
    nested value) gets `_plain_any`, so the answer is the same."""
    if value.__class__ is not dict:
        return _plain_any(value)
    for key, item in value.items():
        if not isinstance(key, str) or "\x00" in key:
            return False
        cls = item.__class__
        if cls is str:
            if "\x00" in item:
                return False
        elif cls is int:
            if not -MAX_SAFE_INT <= item <= MAX_SAFE_INT:
                return False
        elif item is not None and not _plain(item):
            return False
    return True


def _plain_any(value: Any) -> bool:
    if value is None or isinstance(value, bool):
        return True
    if isinstance(value, int):
        return -MAX_SAFE_INT <= value <= MAX_SAFE_INT
    if isinstance(value, str):
        return "\x00" not in value
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str) or "\x00" in key or not _plain(item):
                return False
        return True
    if isinstance(value, list | tuple):
        return all(_plain(item) for item in value)
    return False  # a float (normalised by canonical_bytes) or not JSON at all


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digest(value: Any) -> str:
    return sha256_hex(canonical_bytes(value))


def _reject_constant(name: str) -> Any:
    raise CanonicalError(f"{name} is not JSON")


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json.loads's `object_pairs_hook` that refuses a key twice in one object
    (CanonicalError "duplicate key 'k'"): parse_strict's, and the MCP gateway's."""
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise CanonicalError(f"duplicate key {key!r}")
        found[key] = value
    return found


def parse_strict(text: str | bytes) -> Any:
    """Parse JSON the one way every entry point must: no duplicate keys, NaN or Infinity,
    nothing nested deeper than MAX_DEPTH.

    A lenient parser keeps the last of two equal keys, so what a person or agent sent and
    what was hashed could differ. Past some depth Python's parser raises RecursionError,
    which no caller expects from bad input (a 500 on the run page's forms): it is refused
    at MAX_DEPTH, well before, like any other bad JSON. Raises CanonicalError (a ValueError)
    with the reason.
    """
    try:
        value = json.loads(text, object_pairs_hook=unique_keys, parse_constant=_reject_constant)
    except CanonicalError:
        raise
    except RecursionError:
        raise CanonicalError(TOO_DEEP) from None
    except ValueError as exc:  # JSONDecodeError, bad UTF-8
        raise CanonicalError(str(exc)) from None
    if deeper_than(value, MAX_DEPTH):
        raise CanonicalError(TOO_DEEP)
    _check(value, "")
    return value


# The deepest nesting parse_strict takes (objects and arrays; the API refuses deeper bodies
# before parsing them, runtime.api.parsers).
MAX_DEPTH = 64
TOO_DEEP = f"JSON nested deeper than {MAX_DEPTH} levels"


def deeper_than(value: Any, limit: int) -> bool:
    """Whether objects and arrays nest more than `limit` levels (without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False
