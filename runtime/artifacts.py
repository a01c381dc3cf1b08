"""Storing state so that bytes grow with what changed, not with the whole state per step.

A value whose canonical JSON is above `INLINE_LIMIT` bytes is stored once, content-addressed,
and referenced by digest. Lists longer than `CHUNK` items are cut into full chunks of `CHUNK`
items, each stored on its own, and a tail of the items after the last full chunk, stored as
a chain of links — each link one item and a reference to the link before it: a list that
grows by one item per step adds one link, not a rewritten partial chunk, so n steps of a
growing state cost O(n) bytes with a small constant. A large item is kept inside its link,
not in an artifact of its own beside it (one row a step, not two), and a chunk of such items
is that same chain once it is full: filling up stores nothing again. A chunk of small items
is stored as their list. The list of two or more chunks' references is stored on its own too
(it changes once every CHUNK items), so the object holding the list stays a few references
long. Identical values — unchanged keys, earlier chunks, earlier links — hash to the same
artifact and are never stored twice. (Checkpoints written in earlier forms — a partial last
chunk, tails whose links referred to items stored beside them — read as they were written.
So do artifacts stored before Holdpoint wrote RFC 8785, under the address of the form of
then, audit.canonical: a value holding a float below 1e-4 or a key beyond U+FFFF is stored
once more under its RFC 8785 address when a later step writes it, and the purge removes the
old copy once no checkpoint names it.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from audit.canonical import canonical, sha256_hex

INLINE_LIMIT = 512
CHUNK = 32
TAIL_INLINE = 128
REF = "$ref"
CHUNKS = "$chunks"
TAIL = "$tail"  # beside CHUNKS: the last link of the items after the full chunks
# A user object that uses any of the encoder's keys is stored boxed, `{"$literal": {…}}`:
# its keys taken as they are, its values encoded. So every JSON state reads back exactly,
# whatever keys it uses (SECURITY.md, L4).
LITERAL = "$literal"


@dataclass
class Encoder:
    """Collects the artifacts a state needs; `new` are those not yet known to be stored."""

    known: set[str] = field(default_factory=set)
    new: dict[str, str] = field(default_factory=dict)

    def encode(self, value: Any) -> Any:
        encoded, final = self._unstored(value)
        if final:
            return encoded
        return self._store(encoded) if len(canonical(encoded)) > INLINE_LIMIT else encoded

    def _unstored(self, value: Any) -> tuple[Any, bool]:
        """A value's encoding before it would be stored on its own; `final`: it never is
        (small, or a list's chunked form, which refers to what it needs)."""
        if value is None or isinstance(value, bool | int | float):
            return value, True  # a few bytes at most; validated with the object that holds it
        if isinstance(value, str) and 6 * len(value) + 2 <= INLINE_LIMIT:
            return value, True  # even fully \u-escaped it stays inline: no need to measure it
        if isinstance(value, dict):
            encoded: Any = {k: self.encode(v) for k, v in value.items()}
            if REF in value or CHUNKS in value or LITERAL in value:  # looks like ours: box it
                encoded = {LITERAL: encoded}
            return encoded, isinstance(encoded, dict) and _surely_inline(encoded)
        if isinstance(value, list):
            return self._encode_list(value)
        return value, False

    def _encode_list(self, value: list[Any]) -> tuple[Any, bool]:
        pieces = [self._piece(item) for item in value]
        if len(value) == CHUNK and not any(big for _, big in pieces):
            # exactly one chunk of small items: stored (or inline) as such a chunk is
            return [encoded for encoded, _ in pieces], False
        full = len(value) - len(value) % CHUNK
        tail = pieces[full:]
        listed = [encoded for encoded, _ in tail]
        # A tail of a few small items stays inline (in the checkpoint, or the artifact, that
        # holds the list); a larger one is a chain, one new link per appended item. (Up to
        # TAIL_INLINE only: a longer inline tail would grow the object that holds it past
        # INLINE_LIMIT, and that object would be stored anew every step.) A large item is
        # always in a link, so that it is stored once: in the link, never also beside it.
        small = not any(big for _, big in tail) and len(canonical(listed)) <= TAIL_INLINE
        if not full and small:
            return listed, True  # a short list: as it is
        chunks: Any = [self._chunk(pieces[i : i + CHUNK]) for i in range(0, full, CHUNK)]
        if len(chunks) > 1:  # their list changes once every CHUNK items: stored, referred to
            chunks = self._store(chunks)
        out: dict[str, Any] = {CHUNKS: chunks, "n": len(value)}
        if tail:
            out[TAIL] = listed if small else self._chain(listed)
        return out, True

    def _piece(self, item: Any) -> tuple[Any, bool]:
        """An item's encoding as it would sit in a link, and whether it is big: stored on its
        own when it is not in a link."""
        encoded, final = self._unstored(item)
        return encoded, not final and len(canonical(encoded)) > INLINE_LIMIT

    def _chunk(self, pieces: list[tuple[Any, bool]]) -> dict[str, str]:
        """A full chunk: the chain its items were linked into while they were the tail (the
        same artifacts, so nothing new) when one of them is big, else their stored list."""
        if any(big for _, big in pieces):
            return self._chain([encoded for encoded, _ in pieces])
        return self._store([encoded for encoded, _ in pieces])

    def reference(self, encoded: Any) -> Any:
        """An encoded value as one reference to its content-addressed blob (stored once):
        what a checkpoint of an unchanged state keeps instead of a copy of it."""
        if isinstance(encoded, dict) and REF in encoded and len(encoded) == 1:
            return encoded
        return self._store(encoded)

    def _chain(self, encoded: list[Any]) -> dict[str, str]:
        """The last link of a chain over the `encoded` items: each link `{"item": …, "prev":
        ref|null}`. Links are content-addressed like everything else, so the links of items
        that were there at the last step are the same artifacts (known, not stored again)."""
        prev: dict[str, str] | None = None
        for item in encoded:
            prev = self._store({"item": item, "prev": prev})
        assert prev is not None  # the caller passes at least one item
        return prev

    def _store(self, encoded: Any) -> dict[str, str]:
        text = canonical(encoded).decode("utf-8")
        digest = sha256_hex(text.encode("utf-8"))
        if digest not in self.known:
            self.new[digest] = text
        return {REF: digest}

    def committed(self) -> None:
        """The new artifacts were stored: remember them so later steps skip them."""
        self.known.update(self.new)
        self.new = {}


def _surely_inline(encoded: dict[str, Any]) -> bool:
    """An upper bound of the canonical size of a flat object of short values is within
    INLINE_LIMIT: no need to serialise it to know it stays inline (most states are this)."""
    size = 2
    for key, item in encoded.items():
        kind = type(item)
        if type(key) is not str:
            return False
        size += 6 * len(key) + 4  # "key": and a comma, every character escaped at worst
        if kind is str:
            size += 6 * len(item) + 2
        elif kind is int or kind is bool or item is None:
            size += 22  # ±2**53 is 16 digits and a sign; true/false/null are shorter
        elif kind is float:
            size += 25  # the longest repr of a float
        elif kind is dict and len(item) == 1 and type(item.get(REF)) is str:
            size += 6 * len(item[REF]) + 12  # (a box's object may hold a user's `$ref`)
        else:
            return False
        if size > INLINE_LIMIT:
            return False
    return True


def collect_refs(value: Any, into: set[str]) -> set[str]:
    """Every artifact digest an encoded value refers to directly (not through artifacts)."""
    if isinstance(value, dict):
        if REF in value and len(value) == 1:
            into.add(value[REF])
        elif _boxed(value):  # a user object: its keys are data, only its values can refer
            for item in value[LITERAL].values():
                collect_refs(item, into)
        else:
            for item in value.values():
                collect_refs(item, into)
    elif isinstance(value, list):
        for item in value:
            collect_refs(item, into)
    return into


def decode(value: Any, load: dict[str, Any]) -> Any:
    """Rebuild a value from its encoding; `load` maps digest -> parsed artifact JSON."""
    if isinstance(value, dict):
        if REF in value and len(value) == 1:
            return decode(load[value[REF]], load)
        if CHUNKS in value:
            out: list[Any] = []
            chunks = value[CHUNKS]
            if isinstance(chunks, dict):  # the chunks' list, stored on its own
                chunks = load[chunks[REF]]
            for chunk in chunks:
                if _is_link(chunk, load):  # a chunk of big items: the chain they were linked in
                    out.extend(_unchain(chunk, load))
                else:
                    out.extend(decode(chunk, load))
            tail = value.get(TAIL)
            if isinstance(tail, list):
                out.extend(decode(item, load) for item in tail)
            elif tail is not None:
                out.extend(_unchain(tail, load))
            return out
        if _boxed(value):
            return {k: decode(v, load) for k, v in value[LITERAL].items()}
        return {k: decode(v, load) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(item, load) for item in value]
    return value


def _is_link(chunk: Any, load: dict[str, Any]) -> bool:
    """A chunk that refers to a link (a chunk's own content is always a list)."""
    if not (isinstance(chunk, dict) and REF in chunk and len(chunk) == 1):
        return False
    return isinstance(load[chunk[REF]], dict)


def _unchain(last: dict[str, str], load: dict[str, Any]) -> list[Any]:
    """The items of a chain, first to last, from a reference to its last link."""
    items: list[Any] = []
    link: Any = last
    while link is not None:
        node = load[link[REF]]
        items.append(decode(node["item"], load))
        link = node["prev"]
    items.reverse()
    return items


def _boxed(value: dict[str, Any]) -> bool:
    """A boxed user object. (Checkpoints written before every reserved key was boxed may
    hold a user's `{"$literal": 5}` as is: not a box, read as written.)"""
    return len(value) == 1 and isinstance(value.get(LITERAL), dict)


def resolve(tenant_id: int, encoded: Any, cache: dict[str, Any] | None = None) -> Any:
    """Decode a stored value, fetching its artifacts (and theirs) in batched rounds."""
    import json

    from runtime.models import Artifact

    cache = {} if cache is None else cache
    wanted = collect_refs(encoded, set()) - cache.keys()
    while wanted:
        rows = Artifact.objects.filter(tenant_id=tenant_id, digest__in=wanted)
        fetched = {row.digest: json.loads(row.content) for row in rows}
        missing = wanted - fetched.keys()
        if missing:
            raise LookupError(f"artifacts missing: {sorted(missing)[:3]}")
        cache.update(fetched)
        wanted = set().union(*(collect_refs(v, set()) for v in fetched.values())) - cache.keys()
    return decode(encoded, cache)
