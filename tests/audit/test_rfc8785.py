"""audit.canonical writes RFC 8785 (JCS), byte for byte (TEST-MATRIX §2 item 5, C7).

An outside verifier recomputes Holdpoint's hashes with any RFC 8785 library, so the bytes
must be RFC 8785's: the RFC's own examples (its appendix B numbers, its key-sorting and
worked examples), each character's escape as JSON.stringify writes it, and — over generated
values of everything Holdpoint takes in — an independent implementation's bytes: `rfc8785`
(Trail of Bits), a test dependency only. The form before RFC 8785 (`legacy_bytes`), kept to
check hashes stored then, must still read back as the value it encodes: that is why
accepting it never lets another value match.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest
import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st

from audit.canonical import (
    MAX_SAFE_INT,
    CanonicalError,
    canonical,
    canonical_bytes,
    canonical_forms,
    digests,
    ecmascript_number,
    legacy_bytes,
    parse_strict,
    sha256_hex,
)

# RFC 8785 appendix B: IEEE 754 bit patterns and what ECMAScript writes for them.
APPENDIX_B = [
    ("0000000000000000", "0"),
    ("8000000000000000", "0"),  # -0
    ("0000000000000001", "5e-324"),
    ("8000000000000001", "-5e-324"),
    ("7fefffffffffffff", "1.7976931348623157e+308"),
    ("ffefffffffffffff", "-1.7976931348623157e+308"),
    ("4340000000000000", "9007199254740992"),
    ("c340000000000000", "-9007199254740992"),
    ("4430000000000000", "295147905179352830000"),
    ("44b52d02c7e14af5", "9.999999999999997e+22"),
    ("44b52d02c7e14af6", "1e+23"),
    ("44b52d02c7e14af7", "1.0000000000000001e+23"),
    ("444b1ae4d6e2ef4e", "999999999999999700000"),
    ("444b1ae4d6e2ef4f", "999999999999999900000"),
    ("444b1ae4d6e2ef50", "1e+21"),
    ("3eb0c6f7a0b5ed8c", "9.999999999999997e-7"),
    ("3eb0c6f7a0b5ed8d", "0.000001"),
    ("41b3de4355555553", "333333333.3333332"),
    ("41b3de4355555554", "333333333.33333325"),
    ("41b3de4355555555", "333333333.3333333"),
    ("41b3de4355555556", "333333333.3333334"),
    ("41b3de4355555557", "333333333.33333343"),
    ("becbf647612f3696", "-0.0000033333333333333333"),
    ("43143ff3c1cb0959", "1424953923781206.2"),
]


def _double(bits: str) -> float:
    value: float = struct.unpack(">d", bytes.fromhex(bits))[0]
    return value


@pytest.mark.parametrize(("bits", "expected"), APPENDIX_B)
def test_every_appendix_b_number_is_written_as_ecmascript_writes_it(
    bits: str, expected: str
) -> None:
    assert ecmascript_number(_double(bits)) == expected


@pytest.mark.parametrize(("bits", "expected"), APPENDIX_B)
def test_appendix_b_numbers_in_holdpoints_range_are_canonical_the_rest_refused(
    bits: str, expected: str
) -> None:
    """Holdpoint takes numbers within ±2**53 only (what every JSON parser it meets reads
    back exactly): appendix B's within it canonicalise to the RFC's text; those beyond it
    (2**53 itself, 1e21, 1e23, the largest double) are refused, never written otherwise."""
    value = _double(bits)
    if abs(value) <= MAX_SAFE_INT:
        assert canonical([value]) == f"[{expected}]".encode()
        assert canonical_bytes({"n": value}) == f'{{"n":{expected}}}'.encode()
    else:
        with pytest.raises(CanonicalError, match="outside ±2\\*\\*53"):
            canonical([value])


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1e-7, "1e-7"),
        (1e-6, "0.000001"),
        (1e-5, "0.00001"),
        (1.5e-5, "0.000015"),
        (0.0001, "0.0001"),
        (0.5, "0.5"),
        (-0.0, "0"),
        (1.0, "1"),
        (100.0, "100"),
        (123.456, "123.456"),
        (2.0**53 - 1, "9007199254740991"),
        (1e21, "1e+21"),
        (1e20, "100000000000000000000"),
        (1.5e300, "1.5e+300"),
        (1e30, "1e+30"),
    ],
)
def test_the_ecmascript_layout_of_numbers_python_writes_otherwise(
    value: float, expected: str
) -> None:
    """Python's repr has the same digits, not the same layout (`1e-07`, `1e-05`, `1.0`)."""
    assert ecmascript_number(value) == expected


RFC_KEYS = {
    "\u20ac": "Euro Sign",
    "\r": "Carriage Return",
    "\ufb33": "Hebrew Letter Dalet With Dagesh",
    "1": "One",
    "\U0001f600": "Emoji: Grinning Face",  # "\ud83d\ude00" in JSON
    "\u0080": "Control",
    "\u00f6": "Latin Small Letter O With Diaeresis",
}


def test_keys_sort_by_utf16_code_units_as_in_section_3_2_3() -> None:
    """The emoji (surrogates D83D DE00) sorts before U+FB33 in UTF-16; by code point
    (U+1F600) it would come after it, as the form before RFC 8785 had it."""
    expected = (
        '{"\\r":"Carriage Return","1":"One","\u0080":"Control",'
        '"\u00f6":"Latin Small Letter O With Diaeresis","\u20ac":"Euro Sign",'
        '"\U0001f600":"Emoji: Grinning Face","\ufb33":"Hebrew Letter Dalet With Dagesh"}'
    )
    assert canonical(RFC_KEYS).decode() == expected
    assert canonical_bytes(RFC_KEYS) == expected.encode()
    parsed = parse_strict('{"\\u20ac":1,"\\ud83d\\ude00":2,"\\ufb33":3}')
    assert canonical(parsed) == '{"\u20ac":1,"\U0001f600":2,"\ufb33":3}'.encode()
    assert list(json.loads(legacy_bytes(RFC_KEYS)))[-1] == "\U0001f600"  # code point order


def test_the_worked_example_of_sections_3_2_2_to_3_2_4() -> None:
    """The RFC's example, parsed as every entry point parses; its 1E30 is beyond Holdpoint's
    range, so it is refused, and the rest is the RFC's output byte for byte."""
    source = (
        '{\n  "numbers": [333333333.33333329, 1E30, 4.50,\n'
        "              2e-3, 0.000000000000000000000000001],\n"
        '  "string": "\\u20ac$\\u000F\\u000aA\'\\u0042\\u0022\\u005c\\\\\\"\\/",\n'
        '  "literals": [null, true, false]\n}'
    )
    value = parse_strict(source.replace("1E30, ", ""))
    expected = (
        '{"literals":[null,true,false],"numbers":[333333333.3333333,4.5,0.002,1e-27],'
        '"string":"\u20ac$\\u000f\\nA\'B\\"\\\\\\\\\\"/"}'
    )
    assert canonical(value) == expected.encode()
    with pytest.raises(CanonicalError, match="outside ±2\\*\\*53"):
        canonical_bytes(parse_strict(source))


def _escaped_as_json_stringify(character: str) -> str:
    """ECMAScript's QuoteJSONString (ES2019+), for one character: the short escapes, every
    other code unit below U+0020 as `\\u00xx` in lower-case hex, the rest as it is."""
    short = {"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
    short |= {'"': '\\"', "\\": "\\\\"}
    if character in short:
        return short[character]
    if character < " ":
        return f"\\u{ord(character):04x}"
    return character


@pytest.mark.parametrize(
    "code", [*range(1, 0x80), 0x80, 0x9F, 0xA0, 0x2028, 0x2029, 0xFEFF, 0xFFFF, 0x1F600]
)
def test_each_character_is_escaped_as_json_stringify_escapes_it(code: int) -> None:
    """Every control character U+0001-U+001F, all of ASCII, and the usual suspects (C1
    controls, line and paragraph separators, BOM, non-characters, a surrogate pair). U+0000
    is refused, as PostgreSQL cannot store it (parse_strict's rule, not RFC 8785's)."""
    character = chr(code)
    text = "a" + character + "b"
    expected = f'"a{_escaped_as_json_stringify(character)}b"'.encode()
    assert canonical(text) == expected
    assert canonical_bytes({text: text}) == b"{" + expected + b":" + expected + b"}"
    assert rfc8785.dumps(text) == expected


def test_nul_and_lone_surrogates_are_refused_not_escaped() -> None:
    for bad in ("a\x00b", "\ud800", {"\udfff": 1}):
        with pytest.raises(CanonicalError):
            canonical(bad)


# --- generated values: round trip, and an independent implementation's bytes ---------------

_characters = st.characters(exclude_categories=("Cs",), exclude_characters="\x00")
# Keys drawn often from characters whose order differs between code points and UTF-16
# (U+E000-U+FFFF against U+10000 and up), so objects put them side by side.
_tricky = st.sampled_from(["\ue000", "\uffff", "\ufb33", "\U00010000", "\U0001f600", "a"])
_keys = st.text(st.one_of(_tricky, _characters), max_size=4)
_numbers = st.one_of(
    st.integers(-MAX_SAFE_INT, MAX_SAFE_INT),
    st.floats(-MAX_SAFE_INT, MAX_SAFE_INT, allow_nan=False),
    st.floats(-1e-4, 1e-4, allow_nan=False),  # where the two forms differ
)
_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.text(_characters, max_size=20), _numbers),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_keys, inner, max_size=5),
    max_leaves=20,
)


@settings(max_examples=1500, deadline=None)
@given(_json)
def test_generated_values_read_back_and_match_an_independent_rfc8785(value: Any) -> None:
    written = canonical(value)
    assert json.loads(written) == value
    assert written == canonical_bytes(value) == rfc8785.dumps(value)
    assert canonical_forms(value)[0] == written
    assert digests(value)[0] == sha256_hex(written)


@settings(max_examples=1000, deadline=None)
@given(_json)
def test_the_form_before_rfc8785_reads_back_as_the_same_value(value: Any) -> None:
    """Why a hash stored in the earlier form may be accepted beside RFC 8785's: each form
    parses back to the very value it encodes, so bytes equal across forms — a value's
    earlier form and another's RFC 8785 form — would be equal values. The forms are given
    both only where they differ, and differ only for a float below 1e-4 or a key beyond
    U+FFFF."""
    before = legacy_bytes(value)
    assert json.loads(before) == value
    forms = canonical_forms(value)
    assert forms == (
        (canonical(value),) if before == canonical(value) else (canonical(value), before)
    )
    if len(forms) == 2:
        floats, keys = _parts(value)
        tiny = any(0 < abs(x) < 1e-4 for x in floats)
        assert tiny or any(ord(c) > 0xFFFF for key in keys for c in key)


def _parts(value: Any) -> tuple[list[float], list[str]]:
    """Every float and every object key in `value`."""
    if isinstance(value, float):
        return [value], []
    floats: list[float] = []
    keys: list[str] = list(value) if isinstance(value, dict) else []
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    for item in items:
        more_floats, more_keys = _parts(item)
        floats += more_floats
        keys += more_keys
    return floats, keys
