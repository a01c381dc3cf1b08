"""The params of a held action as a form, built from the tool's JSON Schema, and back.

`param_fields` turns the schema `shown` to the reviewer (frozen at request time) into one
input per property; `edits_from` reads a posted form back into typed values — only the
fields the reviewer changed. Nothing here decides: an edit of a field the tool does not let
reviewers edit is passed on and refused by `decide` (field_not_editable), and the edited
params are validated against the schema there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from django.http import QueryDict

from audit.canonical import CanonicalError, parse_strict
from runtime.errors import InvalidParams
from runtime.pages import pretty
from runtime.tools import get_tool

# A string field longer than this (or with line breaks) gets a textarea.
SHORT_TEXT = 300


@dataclass
class ParamField:
    """One input of the params form; `kind` picks the widget."""

    name: str
    kind: str  # text, textarea, integer, number, checkbox, select, json
    value: str
    checked: bool
    editable: bool
    required: bool
    description: str = ""
    choices: list[str] = field(default_factory=list)
    attrs: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    present: bool = True


def _kind(spec: dict[str, Any], value: Any) -> str:
    if "enum" in spec:
        return "select"
    kind = spec.get("type")
    if kind is None:  # a schema without this property: infer from the value
        kind = {bool: "boolean", int: "integer", float: "number", str: "string"}.get(
            type(value), "json"
        )
    if kind == "boolean":
        return "checkbox"
    if kind in ("integer", "number"):
        return kind
    if kind == "string":
        long_ = int(spec.get("maxLength", SHORT_TEXT + 1)) > SHORT_TEXT
        return "textarea" if long_ or "\n" in str(value or "") else "text"
    return "json"


def _shown_value(kind: str, value: Any) -> str:
    if value is None:
        return ""
    if kind == "json":
        return pretty(value)
    if kind == "checkbox":
        return ""
    return str(value)


def property_order(shown: dict[str, Any], props: dict[str, Any]) -> list[str]:
    """The order the tool declares its properties in.

    `shown` is stored as JSON, and PostgreSQL's jsonb keeps object keys sorted its own way
    (shortest first), so the stored schema cannot tell the order. The registered tool of
    the same version can (a built-in tool: a tenant's definitions are stored as JSON too);
    any other tool gets required fields first, then the rest alphabetically — the same on
    every database.
    """
    try:
        tool = get_tool(str(shown.get("tool", "")))
    except InvalidParams:
        tool = None
    if tool is not None and tool.version == shown.get("tool_version"):
        declared = [n for n in tool.schema.get("properties", {}) if n in props]
        return declared + sorted(n for n in props if n not in declared)
    required = [n for n in (shown.get("schema") or {}).get("required", ()) if n in props]
    return required + sorted(n for n in props if n not in required)


def param_fields(
    shown: dict[str, Any],
    params: dict[str, Any],
    *,
    enabled: bool,
    drafts: dict[str, str] | None = None,
    errors: dict[str, list[str]] | None = None,
) -> list[ParamField]:
    """An input per schema property (then any param the schema does not name), in the
    tool's order; editable ones enabled when the user may decide, the others read-only."""
    schema = shown.get("schema") or {}
    props: dict[str, Any] = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    editable = set(shown.get("editable") or ())
    names = property_order(shown, props) + [n for n in params if n not in props]
    fields: list[ParamField] = []
    for name in names:
        spec = props.get(name) or {}
        value = params.get(name)
        kind = _kind(spec, value)
        attrs = {
            k: spec[k]
            for k in ("minLength", "maxLength", "minimum", "maximum")
            if isinstance(spec.get(k), int | float)
        }
        draft = (drafts or {}).get(name)
        fields.append(
            ParamField(
                name=name,
                kind=kind,
                value=draft if draft is not None else _shown_value(kind, value),
                checked=value is True,
                editable=enabled and name in editable,
                required=name in required,
                description=str(spec.get("description", "")),
                choices=[str(c) for c in spec.get("enum", ())],
                attrs=attrs,
                error="; ".join((errors or {}).get(name, ())),
                present=name in params,
            )
        )
    return fields


_MISSING = object()


def _coerce(kind: str, raw: str | None) -> Any:
    """A posted value in the schema's type; ValueError with a reviewer-readable message."""
    if kind == "checkbox":
        return raw is not None
    text = (raw or "").replace("\r\n", "\n")  # browsers send textarea lines as CRLF
    if kind == "integer":
        try:
            return int(text)
        except ValueError:
            raise ValueError("must be a whole number") from None
    if kind == "number":
        try:
            number = float(text)
        except ValueError:
            raise ValueError("must be a number") from None
        return int(number) if number.is_integer() and "." not in text else number
    if kind == "json":
        try:
            return parse_strict(text)
        except CanonicalError as exc:
            raise ValueError(f"is not valid JSON: {exc}") from None
    return text


def edits_from(
    post: QueryDict, shown: dict[str, Any], params: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The fields the reviewer changed (and only those), plus the raw drafts to re-show.

    Non-editable fields are disabled in the form, so a browser never sends them; one that
    arrives anyway and differs is passed on, and `decide` refuses it (field_not_editable).
    """
    edits: dict[str, Any] = {}
    drafts: dict[str, str] = {}
    errors: dict[str, list[str]] = {}
    editable = set(shown.get("editable") or ())
    for f in param_fields(shown, params, enabled=True):
        key = f"param-{f.name}"
        if key not in post and not (f.kind == "checkbox" and f.name in editable):
            continue
        raw = post.get(key)
        drafts[f.name] = raw or ""
        try:
            value = _coerce(f.kind, raw)
        except ValueError as exc:
            errors[f.name] = [f"{f.name} {exc}"]
            continue
        before = params.get(f.name, _MISSING)
        if before is _MISSING and value in ("", False):
            continue  # an optional field left empty is not an edit
        if value != before:
            edits[f.name] = value
    if errors:
        raise InvalidParams("some fields could not be read", errors=errors, drafts=drafts)
    return edits, drafts


# The request page's approve form carries this marker beside the params the reviewer sees,
# so the server knows the post holds what they typed (a post without it has no params).
TYPED_MARKER = "params-typed"
WITH_EDITS = "edit"


class UnsentEdits(InvalidParams):
    """The page's plain Approve was pressed with changed fields (a page refusal, not an
    API error: the API's decision carries its edits explicitly)."""

    code = "unsent_edits"
    status = 409
    title = "Edits not sent"


def typed_edits(
    post: QueryDict, shown: dict[str, Any], params: dict[str, Any]
) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """The edits an approval from the request page carries, or a refusal.

    Both Approve buttons post the params form as the reviewer left it (issue 15.4: an edit
    is never dropped silently). "Approve with my edits" (`mode=edit`) sends the changed
    fields as edits. The plain Approve button approves the action as shown only if nothing
    was changed; with changed fields it is refused — nothing decided, the typed values kept
    on the page — because approving the original would silently drop what the reviewer
    typed, and sending edits from a button that does not say so would surprise them.
    """
    if post.get(TYPED_MARKER) != "1" and post.get("mode") != WITH_EDITS:
        return None, {}  # a post that carries no params (not the page's form): no edits
    edits, drafts = edits_from(post, shown, params)
    if edits and post.get("mode") != WITH_EDITS:
        changed = ", ".join(sorted(edits))
        raise UnsentEdits(
            f"you changed {changed}: Approve would approve the original action without your "
            "edits — press “Approve with my edits” to approve the edited action, or undo the "
            "changes to approve it as shown",
            errors={name: ["changed — not sent by Approve"] for name in edits},
            drafts=drafts,
        )
    return edits or None, drafts


@dataclass(frozen=True)
class DiffRow:
    name: str
    before: str
    after: str
    changed: bool


def diff_rows(original: dict[str, Any], edited: dict[str, Any], order: list[str]) -> list[DiffRow]:
    """Original vs edited, field by field, in the tool's order (then any other field)."""
    names = [n for n in order if n in original or n in edited]
    names += sorted((set(original) | set(edited)) - set(names))
    rows = []
    for name in names:
        before, after = original.get(name, _MISSING), edited.get(name, _MISSING)
        rows.append(DiffRow(name, _diff_text(before), _diff_text(after), before != after))
    return rows


def _diff_text(value: Any) -> str:
    if value is _MISSING:
        return ""
    return value if isinstance(value, str) else pretty(value)
