"""Canonical JSON bytes (RFC 8785, the JSON Canonicalization Scheme) for hashing.

Hashes must cover exactly the bytes that are stored, and the same value must always give the
same bytes — RFC 8785's, so that anyone with an RFC 8785 library recomputes every hash: keys
sorted by their UTF-16 code units, no insignificant white space, UTF-8, strings escaped as
ECMAScript's JSON.stringify does, numbers written as its Number.prototype.toString does (the
shortest digits that read back as the same double: `1e-7`, `0.00001`, `1.5`; `1.0` and `-0.0`
as `1` and `0`). No NaN/Infinity (which JSON does not define and parsers disagree on).
Numbers are limited to what survives a round trip through every JSON parser the product
meets: integers within ±2**53, finite floats within the same range.

`canonical_bytes` is the definition; `canonical` gives the same bytes several times faster
for the values hashed on every durable step, and falls back to the definition for the rest.

**The form before RFC 8785.** Holdpoint first wrote Python's `json.dumps(sort_keys=True)`
bytes ("RFC 8785 style"). They are RFC 8785's for every value but two kinds: a float below
1e-4 in magnitude (Python wrote `1e-05` and `1e-07` where ECMAScript writes `0.00001` and
`1e-7`), and an object with a key beyond U+FFFF (Python sorted by code point, which puts
such a key after one holding U+E000-U+FFFF at the same place; UTF-16 before). Hashes made
then are kept as they are — rewriting them would rewrite history (audit.chain) and stale
every anchor — so whoever checks a stored hash against a value accepts that form too:
`canonical_forms` and `digests` give both (one when they agree, as for nearly every value).
Accepting either never lets another value match: both are JSON texts that parse back to the
very value they encode, so equal bytes are equal values.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
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


def canonical_bytes(value: Any) -> bytes:
    """The one byte form of a JSON value that hashes and storage agree on (RFC 8785)."""
    _check(value, "")
    return _write(value).encode("utf-8")


def _write(value: Any) -> str:
    """RFC 8785's text of a value `_check` accepted."""
    if isinstance(value, str):
        return _ESCAPE(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float):
        return ecmascript_number(value)
    if isinstance(value, dict):
        # RFC 8785 sorts keys by UTF-16 code units, which is code point order (Python's)
        # unless a key holds a character beyond U+FFFF.
        pairs = sorted(value.items()) if _plain_keys(value) else _utf16_sorted(value)
        return "{" + ",".join([_ESCAPE(key) + ":" + _write(item) for key, item in pairs]) + "}"
    return "[" + ",".join([_write(item) for item in value]) + "]"


def _utf16_sorted(value: dict[str, Any]) -> list[tuple[str, Any]]:
    """An object's pairs in UTF-16 order of their keys: big-endian UTF-16 bytes compare as
    the code units do."""
    return sorted(value.items(), key=lambda pair: pair[0].encode("utf-16-be"))


def ecmascript_number(x: float) -> str:
    """A finite double as ECMAScript's Number::toString writes it (RFC 8785 section 3.2.2.3).

    Its digits are the shortest that read back as `x`, the nearest to `x` of those — exactly
    Python's repr's. Only the layout differs: positional from 1e-6 up to 1e21 (`0.000001`,
    `100`), exponent form outside it (`1e-7`, `1e+21`), no `.0`, no exponent zero padding."""
    if x == 0:
        return "0"  # -0 too
    if x < 0:
        return "-" + ecmascript_number(-x)
    mantissa, _, exponent = float.__repr__(x).partition("e")
    whole, _, fraction = mantissa.partition(".")
    significant = (whole + fraction).lstrip("0")
    # ECMAScript's n: x = 0.<digits> * 10**n, digits without leading or trailing zeros.
    n = len(whole) - (len(whole) + len(fraction) - len(significant)) + int(exponent or 0)
    digits = significant.rstrip("0")
    k = len(digits)
    if k <= n <= 21:
        return digits + "0" * (n - k)
    if 0 < n <= 21:
        return digits[:n] + "." + digits[n:]
    if -6 < n <= 0:
        return "0." + "0" * -n + digits
    e = n - 1
    return f"{digits[0]}{'.' + digits[1:] if k > 1 else ''}e{'+' if e > 0 else '-'}{abs(e)}"


def legacy_bytes(value: Any) -> bytes:
    """The form before RFC 8785 (see the module docstring): only to check hashes stored then."""
    _check(value, "")
    return json.dumps(
        _normalise(value),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    ).encode("utf-8")


def _normalise(value: Any) -> Any:
    """The form before RFC 8785 wrote 1.0 and -0.0 as 1 and 0 already."""
    if isinstance(value, float) and value.is_integer() and abs(value) <= MAX_SAFE_INT:
        return int(value)
    if isinstance(value, dict):
        return {key: _normalise(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_normalise(item) for item in value]
    return value


def canonical_forms(value: Any) -> tuple[bytes, ...]:
    """Every byte form a hash of `value` may have been made of: RFC 8785's, then the form
    before it where that differs (see the module docstring). For whoever checks a hash
    stored before against a value at hand; what is hashed now is `canonical`."""
    fast = _fast(value)
    if fast is not None:  # no float, no key beyond U+FFFF: the forms agree
        return (fast,)
    current, before = canonical_bytes(value), legacy_bytes(value)
    return (current,) if before == current else (current, before)


def digests(value: Any) -> tuple[str, ...]:
    """sha256 of each of `canonical_forms(value)`: RFC 8785's first."""
    return tuple(sha256_hex(form) for form in canonical_forms(value))


# --- the same bytes, fast, for what is hashed on every step --------------------------------
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
# How json escapes a string with ensure_ascii off (the C function when there is one): the
# escaping RFC 8785 asks for, as JSON.stringify does it — `\b \t \n \f \r \" \\`, any other
# character below U+0020 as `\u00xx` (lower-case hex), everything else as it is (U+007F,
# U+2028 and `/` too). tests/audit/test_rfc8785.py checks it character by character.
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

# A character beyond U+FFFF: two UTF-16 code units, where the code point order of keys and
# their UTF-16 order part.
_ASTRAL = re.compile("[\U00010000-\U0010ffff]")


def canonical(value: Any) -> bytes:
    """`canonical_bytes(value)`, byte for byte, at a fraction of its cost for what is hashed
    on every step (journal entries, checkpoints, artifacts): values with no float and no key
    beyond U+FFFF. Such a value's RFC 8785 form is what `json.dumps` writes with sorted keys
    (code point order is UTF-16 order within the BMP), so once it passes the same checks —
    string keys, no NUL, no lone surrogate, integers within ±2**53 — the C encoder gives the
    same bytes. Anything else (a float, a key beyond U+FFFF, a value that fails a check) goes
    to `canonical_bytes` itself, which writes it or refuses it with the precise reason."""
    if _plain(value):  # `_fast`, inline: this is on every durable step
        try:
            return _encode(value).encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: let canonical_bytes say where
            pass
    return canonical_bytes(value)


def _fast(value: Any) -> bytes | None:
    """`canonical_bytes(value)` by the C encoder, or None if that might not be the same."""
    if _plain(value):
        try:
            return _encode(value).encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: let canonical_bytes say where
            pass
    return None


def _plain(value: Any) -> bool:
    """`_plain_any(value)`, with the common case — an object of str/int/None values, as every
    step hashes several of — checked in one loop instead of one call per value, and its keys
    all at once. Only values of exactly these classes take the shortcut; anything else (a
    str or int subclass, a nested value) gets `_plain_any`, so the answer is the same."""
    if value.__class__ is not dict:
        return _plain_any(value)
    try:  # `_plain_keys(value)`, inline
        keys = "".join(value)
    except TypeError:
        return False
    if "\x00" in keys or not (keys.isascii() or _ASTRAL.search(keys) is None):
        return False
    for item in value.values():
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
        return _plain_keys(value) and all(_plain(item) for item in value.values())
    if isinstance(value, list | tuple):
        return all(_plain(item) for item in value)
    return False  # a float (written by canonical_bytes) or not JSON at all


def _plain_keys(value: dict[Any, Any]) -> bool:
    """String keys, none with a NUL or a character beyond U+FFFF — all checked in one string:
    joined (a TypeError if one is not a str), then searched. Most keys are ASCII, and an
    ASCII string says so without being read (a flag of the str)."""
    try:
        keys = "".join(value)
    except TypeError:
        return False
    return "\x00" not in keys and (keys.isascii() or _ASTRAL.search(keys) is None)


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


_NESTING = (dict, list)


def deeper_than(value: Any, limit: int) -> bool:
    """Whether objects and arrays nest more than `limit` levels (without recursion). Only
    objects and arrays are stacked: an action's params and its answer are checked on every
    action, most of their values scalars."""
    if not isinstance(value, _NESTING):
        return False
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        deeper = depth + 1
        for child in item.values() if isinstance(item, dict) else item:
            if isinstance(child, _NESTING):
                stack.append((child, deeper))
    return False
