"""Structural diff of two OpenAPI 3.0 documents, reporting changes that can break clients.

The comparison is direction-aware. In a request the client is the writer, so the risk is the
server accepting less (a new required field, a narrower enum). In a response the client is the
reader, so the risk is the server sending something it did not promise before (a missing field,
a different type). Additions that old clients can ignore are never reported.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

Doc = dict[str, Any]
Risk = dict[str, str]
_Pair = tuple[object, object]

HTTP_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
_JSON = "application/json"
_SPEC_NAME = re.compile(r"[a-z0-9-]+")
_TEMPLATE = re.compile(r"\{([^}/]+)\}")
_SPECS_DIR = Path(__file__).resolve().parent / "specs"
_NO_PAIRS: frozenset[_Pair] = frozenset()


def load_spec(name: str) -> Doc:
    """Load a bundled document; the name check keeps callers inside the specs folder."""
    if not isinstance(name, str) or not _SPEC_NAME.fullmatch(name):
        raise ValueError(f"invalid spec name: {name!r}")
    with (_SPECS_DIR / f"{name}.json").open(encoding="utf-8") as fh:
        doc: Doc = json.load(fh)
    return doc


def find_risks(old: Doc, new: Doc, scope: list[str] | None = None) -> list[Risk]:
    """Diff `old` against `new`, limited to paths under `scope`, in a stable order for review."""
    differ = _Differ(old, new)
    for path, item in sorted(_paths(old).items()):
        if _in_scope(path, scope):
            differ.compare_path(path, item)
    return differ.result()


def _in_scope(path: str, scope: list[str] | None) -> bool:
    """Match whole segments so that "/orders" does not drag in "/ordersx"."""
    if scope is None:
        return True
    for prefix in scope:
        base = prefix.rstrip("/")
        if path in (prefix, base) or path.startswith(base + "/"):
            return True
    return False


def _paths(doc: Doc) -> Doc:
    return doc.get("paths") or {}


def _normalise(path: str) -> str:
    """Renaming a path parameter does not change the URL a client calls."""
    return _TEMPLATE.sub("{}", path)


class _Resolver:
    """Follows local $refs in one document.

    A ref that cannot be followed (external, dangling or cyclic) resolves to an empty schema, so
    one bad pointer costs only the findings beneath it rather than the whole review.
    """

    def __init__(self, doc: Doc) -> None:
        self.doc = doc

    def deref(self, node: Any) -> tuple[Doc, str | None]:
        seen: set[str] = set()
        ref = None
        while isinstance(node, dict) and isinstance(node.get("$ref"), str):
            ref = node["$ref"]
            if ref in seen:
                return {}, ref
            seen.add(ref)
            node = self._lookup(ref)
        return (node if isinstance(node, dict) else {}), ref

    def schema(self, node: Any) -> tuple[Doc, str | None]:
        """Clients see an allOf as one object, so compare the merged shape."""
        resolved, ref = self.deref(node)
        return self._merge_all_of(resolved, {ref} if ref else set()), ref

    def _lookup(self, ref: str) -> Any:
        if not ref.startswith("#/"):
            return None
        node: Any = self.doc
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    def _merge_all_of(self, schema: Doc, seen: set[str]) -> Doc:
        if not isinstance(schema.get("allOf"), list):
            return schema
        merged = {key: value for key, value in schema.items() if key != "allOf"}
        for part in schema["allOf"]:
            sub, ref = self.deref(part)
            if ref is None or ref not in seen:
                _absorb(merged, self._merge_all_of(sub, seen | {ref} if ref else seen))
        return merged


def _absorb(merged: Doc, part: Doc) -> None:
    """Fold one allOf member in; the outer schema wins where both say something."""
    properties = {**(part.get("properties") or {}), **(merged.get("properties") or {})}
    required = list(merged.get("required") or [])
    required += [name for name in part.get("required") or [] if name not in required]
    if properties:
        merged["properties"] = properties
    if required:
        merged["required"] = required
    for key in ("type", "enum", "nullable", "items"):
        if key in part:
            merged.setdefault(key, part[key])


@dataclass(frozen=True)
class _Site:
    """Where a comparison is happening, so that every finding can say exactly where."""

    path: str
    method: str
    label: str = ""
    request: bool = False
    type_kind: str = "type_changed"


class _Differ:
    """Walks both documents in step and collects findings, de-duplicated."""

    def __init__(self, old: Doc, new: Doc) -> None:
        self.old = _Resolver(old)
        self.new = _Resolver(new)
        self.new_paths = {_normalise(path): path for path in _paths(new)}
        self.risks: set[tuple[str, str, str, str]] = set()

    def result(self) -> list[Risk]:
        keys = ("path", "method", "kind", "detail")
        return [dict(zip(keys, risk, strict=True)) for risk in sorted(self.risks)]

    def add(self, site: _Site, kind: str, detail: str) -> None:
        self.risks.add((site.path, site.method, kind, detail))

    def compare_path(self, path: str, old_raw: Any) -> None:
        new_path = self.new_paths.get(_normalise(path))
        if new_path is None:
            self.add(_Site(path, "*"), "operation_removed", "path removed")
            return
        old_item = self.old.deref(old_raw)[0]
        new_item = self.new.deref(_paths(self.new.doc)[new_path])[0]
        renames = dict(zip(_TEMPLATE.findall(new_path), _TEMPLATE.findall(path), strict=False))
        for method in HTTP_METHODS:
            if method in old_item:
                self.compare_operation(_Site(path, method.upper()), old_item, new_item, renames)

    def compare_operation(
        self, site: _Site, old_item: Doc, new_item: Doc, renames: dict[str, str]
    ) -> None:
        """Path-level parameters apply to every operation, so they are compared per operation."""
        method = site.method.lower()
        if method not in new_item:
            self.add(site, "operation_removed", "operation removed")
            return
        old_op, new_op = old_item[method], new_item[method]
        old_params = self.parameters(self.old, old_item, old_op, {})
        new_params = self.parameters(self.new, new_item, new_op, renames)
        self.compare_parameters(site, old_params, new_params)
        self.compare_request_body(site, old_op, new_op)
        self.compare_responses(site, old_op, new_op)

    @staticmethod
    def parameters(
        resolver: _Resolver, item: Doc, op: Doc, renames: dict[str, str]
    ) -> dict[tuple[str, str], Doc]:
        """Key parameters the way a server tells them apart; operation-level ones override."""
        found: dict[tuple[str, str], Doc] = {}
        for raw in [*(item.get("parameters") or []), *(op.get("parameters") or [])]:
            param = resolver.deref(raw)[0]
            where, name = str(param.get("in", "")), str(param.get("name", ""))
            if where == "path":
                name = renames.get(name, name)
            found[(where, name.lower() if where == "header" else name)] = param
        return found

    def compare_parameters(
        self, site: _Site, old: dict[tuple[str, str], Doc], new: dict[tuple[str, str], Doc]
    ) -> None:
        for key, param in sorted(new.items()):
            label = f"{key[0]} parameter '{key[1]}'"
            before = old.get(key)
            if _param_required(param) and not (before and _param_required(before)):
                detail = f"{label} became required" if before else f"new required {label}"
                self.add(site, "parameter_required_added", detail)
            if before is not None:
                where = replace(site, label=label, request=True, type_kind="parameter_type_changed")
                self.compare_schema(_param_schema(before), _param_schema(param), where)

    def compare_request_body(self, site: _Site, old_op: Doc, new_op: Doc) -> None:
        old_body = self.old.deref(old_op["requestBody"])[0] if "requestBody" in old_op else None
        new_body = self.new.deref(new_op["requestBody"])[0] if "requestBody" in new_op else None
        if new_body is not None and new_body.get("required"):
            if old_body is None or not old_body.get("required"):
                detail = "request body became required" if old_body else "new required request body"
                self.add(site, "request_body_required_added", detail)
        if old_body is None or new_body is None:
            return
        new_content = new_body.get("content") or {}
        for media, old_media in sorted((old_body.get("content") or {}).items()):
            if media in new_content:
                where = replace(site, label=_body_label("request body", media), request=True)
                self.compare_schema(
                    _media_schema(old_media), _media_schema(new_content[media]), where
                )

    def compare_responses(self, site: _Site, old_op: Doc, new_op: Doc) -> None:
        """Only success bodies are a contract clients parse; error shapes are out of scope."""
        new_responses = {str(code): raw for code, raw in (new_op.get("responses") or {}).items()}
        old_responses = {str(code): raw for code, raw in (old_op.get("responses") or {}).items()}
        for code, raw in sorted(old_responses.items()):
            if not code.startswith("2"):
                continue
            if code not in new_responses:
                self.add(site, "response_removed", f"response {code} removed")
                continue
            old_content = self.old.deref(raw)[0].get("content") or {}
            new_content = self.new.deref(new_responses[code])[0].get("content") or {}
            for media, old_media in sorted(old_content.items()):
                where = replace(site, label=_body_label(f"response {code} body", media))
                new_schema = _media_schema(new_content.get(media))
                self.compare_schema(_media_schema(old_media), new_schema, where)

    def compare_schema(
        self,
        old_node: Any,
        new_node: Any,
        site: _Site,
        ptr: str = "",
        seen: frozenset[_Pair] = _NO_PAIRS,
    ) -> None:
        """Compare two schemas in step; a pair of refs already on the stack means a cycle."""
        old, old_ref = self.old.schema(old_node)
        new, new_ref = self.new.schema(new_node)
        pair = (old_ref or id(old_node), new_ref or id(new_node))
        if pair in seen:
            return
        seen = seen | {pair}
        change = _type_risk(old, new, site.request)
        if change:
            self.add(site, site.type_kind, _detail(site, ptr, change))
        if not _same_shape(old, new):
            return
        self.compare_enum(old, new, site, ptr)
        self.compare_properties(old, new, site, ptr, seen)
        if "items" in old and "items" in new:
            self.compare_schema(old["items"], new["items"], site, ptr + "[]", seen)

    def compare_enum(self, old: Doc, new: Doc, site: _Site, ptr: str) -> None:
        """A new enum on a free value only hurts writers; lost values are reported both ways."""
        message = _enum_narrowing(old.get("enum"), new.get("enum"), site.request)
        if message:
            self.add(site, "enum_narrowed", _detail(site, ptr, message))

    def compare_properties(
        self, old: Doc, new: Doc, site: _Site, ptr: str, seen: frozenset[_Pair]
    ) -> None:
        old_props = old.get("properties") or {}
        new_props = new.get("properties") or {}
        if site.request:
            self.compare_required(old, new, site, ptr)
        for name, sub in old_props.items():
            child = _join(ptr, name)
            if name in new_props:
                self.compare_schema(sub, new_props[name], site, child, seen)
            elif not site.request and not self.old.schema(sub)[0].get("writeOnly"):
                self.add(site, "response_field_removed", _detail(site, child, "removed"))

    def compare_required(self, old: Doc, new: Doc, site: _Site, ptr: str) -> None:
        """Read-only properties are never sent by clients, so requiring them costs nothing."""
        old_props = old.get("properties") or {}
        new_props = new.get("properties") or {}
        for name in sorted(set(new.get("required") or []) - set(old.get("required") or [])):
            if self.new.schema(new_props.get(name))[0].get("readOnly"):
                continue
            child = _join(ptr, name)
            what = (
                f"property '{child}' became required"
                if name in old_props
                else f"new required property '{child}'"
            )
            self.add(site, "request_field_required_added", f"{site.label}: {what}")


def _enum_narrowing(old: Any, new: Any, request: bool) -> str | None:
    if not isinstance(new, list):
        return None
    if not isinstance(old, list):
        return f"enum introduced: {_values(new)}" if request else None
    kept = {_canonical(value) for value in new}
    removed = [value for value in old if _canonical(value) not in kept]
    return f"enum values removed: {_values(removed)}" if removed else None


def _param_required(param: Doc) -> bool:
    return param.get("in") == "path" or bool(param.get("required"))


def _param_schema(param: Doc) -> Any:
    if "schema" in param:
        return param["schema"]
    for media in (param.get("content") or {}).values():
        return _media_schema(media)
    return {}


def _media_schema(media: Any) -> Any:
    return media.get("schema", {}) if isinstance(media, dict) else {}


def _body_label(base: str, media: str) -> str:
    return base if media == _JSON else f"{base} ({media})"


def _type_of(schema: Doc) -> str | None:
    """Schemas often leave `type` implicit; infer it so a real change is not missed."""
    kind = schema.get("type")
    if isinstance(kind, list):
        return "|".join(sorted(str(k) for k in kind))
    if kind is not None:
        return str(kind)
    if "properties" in schema:
        return "object"
    return "array" if "items" in schema else None


def _same_shape(old: Doc, new: Doc) -> bool:
    before, after = _type_of(old), _type_of(new)
    return before is None or after is None or before == after


def _type_risk(old: Doc, new: Doc, request: bool) -> str | None:
    """A request may widen (integer -> number, gain null); a response may only narrow."""
    before, after = _type_of(old), _type_of(new)
    if before is None or after is None:
        return None
    narrow, wide = (before, after) if request else (after, before)
    if before != after and (narrow, wide) != ("integer", "number"):
        return f"type {before} -> {after}"
    gained_null = bool(new.get("nullable")) and not old.get("nullable")
    lost_null = bool(old.get("nullable")) and not new.get("nullable")
    if lost_null if request else gained_null:
        return f"type {_nullable(before, old)} -> {_nullable(after, new)}"
    return None


def _nullable(kind: str, schema: Doc) -> str:
    return f"{kind} (nullable)" if schema.get("nullable") else kind


def _canonical(value: Any) -> str:
    """Compare enum values as JSON so that 1, 1.0 and True are told apart where JSON does."""
    return json.dumps(value, sort_keys=True)


def _values(values: list[Any]) -> str:
    return ", ".join(
        f"'{value}'" if isinstance(value, str) else _canonical(value) for value in values
    )


def _join(ptr: str, name: str) -> str:
    return f"{ptr}/{name}" if ptr else name


def _detail(site: _Site, ptr: str, message: str) -> str:
    if not ptr:
        return f"{site.label}: {message}"
    noun = "items" if ptr.endswith("[]") else "property"
    return f"{site.label}: {noun} '{ptr}' {message}"
