"""Tests for the api-review structural diff (pure Python, no database)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.agents.api_review.diff import find_risks, load_spec

JSON = "application/json"


def _ref(name: str, kind: str = "schemas") -> dict[str, str]:
    return {"$ref": f"#/components/{kind}/{name}"}


def _body(schema: Any) -> dict[str, Any]:
    return {"content": {JSON: {"schema": schema}}}


def _op(
    request: Any = None,
    response: Any = None,
    params: list[Any] | None = None,
    body_required: bool = True,
) -> dict[str, Any]:
    op: dict[str, Any] = {"responses": {"200": {"description": "ok", **_body(response or {})}}}
    if request is not None:
        op["requestBody"] = {"required": body_required, **_body(request)}
    if params is not None:
        op["parameters"] = params
    return op


def _doc(paths: dict[str, Any], schemas: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "openapi": "3.0.3",
        "info": {"title": "t", "version": "1"},
        "paths": paths,
        "components": {"schemas": schemas or {}},
    }


def _obj(required: list[str] | None = None, **props: Any) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        schema["required"] = required
    return schema


def _query(name: str, required: bool = False, **schema: Any) -> dict[str, Any]:
    return {
        "name": name,
        "in": "query",
        "required": required,
        "schema": schema or {"type": "string"},
    }


def _triples(risks: list[dict[str, str]]) -> list[tuple[str, str, str]]:
    return [(r["path"], r["method"], r["kind"]) for r in risks]


def _kinds(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return [r["kind"] for r in find_risks(old, new)]


def _details(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return [r["detail"] for r in find_risks(old, new)]


# --- bundled specs -------------------------------------------------------------------------

EXPECTED = [
    ("/orders", "POST", "request_field_required_added"),
    ("/orders/{order_id}", "GET", "type_changed"),
    ("/users", "GET", "enum_narrowed"),
]


def test_bundled_specs_give_exactly_three_risks() -> None:
    risks = find_risks(load_spec("shop-v1"), load_spec("shop-v2"))
    assert _triples(risks) == EXPECTED
    assert [r["detail"] for r in risks] == [
        "request body: new required property 'shipping_address_id'",
        "response 200 body: property 'total' type number -> string",
        "query parameter 'sort': enum values removed: 'created_at', '-created_at'",
    ]
    assert all(set(r) == {"path", "method", "kind", "detail"} for r in risks)


def test_bundled_specs_split_by_scope() -> None:
    old, new = load_spec("shop-v1"), load_spec("shop-v2")
    assert _triples(find_risks(old, new, ["/orders"])) == EXPECTED[:2]
    assert _triples(find_risks(old, new, ["/users"])) == EXPECTED[2:]
    assert find_risks(old, new, ["/carts"]) == []


def test_bundled_compatible_addition_is_not_reported() -> None:
    old, new = load_spec("shop-v1"), load_spec("shop-v2")
    old_names = {p.get("name") for p in old["paths"]["/orders"]["get"]["parameters"]}
    new_params = new["paths"]["/orders"]["get"]["parameters"]
    added = [p for p in new_params if p.get("name") not in old_names]
    assert [p["name"] for p in added] == ["placed_after"]
    assert added[0]["required"] is False
    assert not [r for r in find_risks(old, new) if "placed_after" in r["detail"]]
    assert find_risks(old, new, ["/orders"]) == [
        r for r in find_risks(old, new) if r["path"].startswith("/orders")
    ]


def test_bundled_specs_are_openapi_3_and_self_consistent() -> None:
    for name in ("shop-v1", "shop-v2"):
        doc = load_spec(name)
        assert doc["openapi"] == "3.0.3"
        assert {p.split("/")[1] for p in doc["paths"]} == {"orders", "users"}
        assert find_risks(doc, doc) == []
    assert find_risks(load_spec("shop-v2"), copy.deepcopy(load_spec("shop-v2"))) == []


@pytest.mark.parametrize("name", ["", "../shop-v1", "Shop-v1", "shop_v1", "a/b", "shop-v1.json"])
def test_load_spec_rejects_bad_names(name: str) -> None:
    with pytest.raises(ValueError):
        load_spec(name)


def test_load_spec_missing_file() -> None:
    with pytest.raises(FileNotFoundError):
        load_spec("no-such-spec")


# --- each kind on hand-made documents --------------------------------------------------------


def test_identical_documents_give_nothing() -> None:
    doc = _doc({"/a": {"get": _op(response=_obj(id={"type": "string"}))}})
    assert find_risks(doc, doc) == []
    assert find_risks(doc, copy.deepcopy(doc)) == []
    assert find_risks(_doc({}), _doc({})) == []


def test_operation_removed_method_and_whole_path() -> None:
    old = _doc({"/a": {"get": _op(), "delete": _op()}, "/b": {"get": _op()}})
    new = _doc({"/a": {"get": _op()}})
    risks = find_risks(old, new)
    assert _triples(risks) == [
        ("/a", "DELETE", "operation_removed"),
        ("/b", "*", "operation_removed"),
    ]
    assert [r["detail"] for r in risks] == ["operation removed", "path removed"]


def test_new_operation_and_renamed_path_parameter_are_compatible() -> None:
    param = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
    renamed = {**param, "name": "order_id"}
    old = _doc({"/o/{id}": {"parameters": [param], "get": _op()}})
    new = _doc({"/o/{order_id}": {"parameters": [renamed], "get": _op(), "put": _op()}})
    assert find_risks(old, new) == []


def test_parameter_required_added() -> None:
    old = _doc({"/a": {"get": _op(params=[_query("q")])}})
    new = _doc(
        {"/a": {"get": _op(params=[_query("q", required=True), _query("r", required=True)])}}
    )
    risks = find_risks(old, new)
    assert _kinds(old, new) == ["parameter_required_added"] * 2
    assert [r["detail"] for r in risks] == [
        "new required query parameter 'r'",
        "query parameter 'q' became required",
    ]


def test_new_optional_parameter_and_removed_parameter_are_compatible() -> None:
    old = _doc({"/a": {"get": _op(params=[_query("gone")])}})
    new = _doc({"/a": {"get": _op(params=[_query("extra")])}})
    assert find_risks(old, new) == []


def test_path_level_parameters_count_for_each_operation() -> None:
    old = _doc({"/a": {"get": _op(), "put": _op()}})
    new = _doc(
        {"/a": {"parameters": [_query("tenant", required=True)], "get": _op(), "put": _op()}}
    )
    assert _triples(find_risks(old, new)) == [
        ("/a", "GET", "parameter_required_added"),
        ("/a", "PUT", "parameter_required_added"),
    ]


def test_parameter_type_changed() -> None:
    old = _doc({"/a": {"get": _op(params=[_query("limit", type="integer")])}})
    new = _doc({"/a": {"get": _op(params=[_query("limit", type="string")])}})
    assert _triples(find_risks(old, new)) == [("/a", "GET", "parameter_type_changed")]
    assert _details(old, new) == ["query parameter 'limit': type integer -> string"]


def test_parameter_widening_integer_to_number_is_compatible() -> None:
    old = _doc({"/a": {"get": _op(params=[_query("limit", type="integer")])}})
    new = _doc({"/a": {"get": _op(params=[_query("limit", type="number")])}})
    assert find_risks(old, new) == []


def test_request_body_required_added() -> None:
    schema = _obj(note={"type": "string"})
    none = _doc({"/a": {"post": _op()}})
    optional = _doc({"/a": {"post": _op(request=schema, body_required=False)}})
    required = _doc({"/a": {"post": _op(request=schema)}})
    assert _details(none, required) == ["new required request body"]
    assert _details(optional, required) == ["request body became required"]
    assert _kinds(optional, required) == ["request_body_required_added"]
    assert find_risks(none, optional) == []
    assert find_risks(required, optional) == []


def test_request_field_required_added() -> None:
    old = _obj(a={"type": "string"})
    new = _obj(["a", "b"], a={"type": "string"}, b={"type": "string"})
    risks = find_risks(
        _doc({"/a": {"post": _op(request=old)}}), _doc({"/a": {"post": _op(request=new)}})
    )
    assert [r["kind"] for r in risks] == ["request_field_required_added"] * 2
    assert [r["detail"] for r in risks] == [
        "request body: new required property 'b'",
        "request body: property 'a' became required",
    ]


def test_request_field_required_added_nested_in_array_items() -> None:
    old = _obj(lines={"type": "array", "items": _obj(sku={"type": "string"})})
    new = _obj(
        lines={
            "type": "array",
            "items": _obj(["qty"], sku={"type": "string"}, qty={"type": "integer"}),
        }
    )
    details = _details(
        _doc({"/a": {"post": _op(request=old)}}), _doc({"/a": {"post": _op(request=new)}})
    )
    assert details == ["request body: new required property 'lines[]/qty'"]


def test_required_read_only_field_is_not_a_request_risk() -> None:
    old = _obj(a={"type": "string"})
    new = _obj(["id"], a={"type": "string"}, id={"type": "string", "readOnly": True})
    assert (
        find_risks(
            _doc({"/a": {"post": _op(request=old)}}), _doc({"/a": {"post": _op(request=new)}})
        )
        == []
    )


def test_new_optional_request_field_and_removed_request_field_are_compatible() -> None:
    old = _obj(a={"type": "string"}, gone={"type": "string"})
    new = _obj(a={"type": "string"}, extra={"type": "integer"})
    assert (
        find_risks(
            _doc({"/a": {"post": _op(request=old)}}), _doc({"/a": {"post": _op(request=new)}})
        )
        == []
    )


def test_type_changed_in_response_with_location() -> None:
    line = _obj(unit_price={"type": "number"})
    old = _obj(total={"type": "number"}, lines={"type": "array", "items": line})
    new = _obj(
        total={"type": "string"},
        lines={"type": "array", "items": _obj(unit_price={"type": "string"})},
    )
    risks = find_risks(
        _doc({"/o": {"get": _op(response=old)}}), _doc({"/o": {"get": _op(response=new)}})
    )
    assert [r["kind"] for r in risks] == ["type_changed", "type_changed"]
    assert [r["detail"] for r in risks] == [
        "response 200 body: property 'lines[]/unit_price' type number -> string",
        "response 200 body: property 'total' type number -> string",
    ]


def test_type_changed_in_request_and_at_the_root() -> None:
    old = _doc(
        {"/o": {"post": _op(request=_obj(n={"type": "integer"}), response={"type": "array"})}}
    )
    new = _doc(
        {"/o": {"post": _op(request=_obj(n={"type": "boolean"}), response={"type": "object"})}}
    )
    assert _details(old, new) == [
        "request body: property 'n' type integer -> boolean",
        "response 200 body: type array -> object",
    ]


def test_type_changed_in_array_items_at_root() -> None:
    old = _doc({"/o": {"get": _op(response={"type": "array", "items": {"type": "string"}})}})
    new = _doc({"/o": {"get": _op(response={"type": "array", "items": {"type": "integer"}})}})
    assert _details(old, new) == ["response 200 body: items '[]' type string -> integer"]


def test_numeric_widening_and_narrowing_follow_direction() -> None:
    def doc(request: str, response: str) -> dict[str, Any]:
        op = _op(request=_obj(n={"type": request}), response=_obj(n={"type": response}))
        return _doc({"/o": {"post": op}})

    assert find_risks(doc("integer", "number"), doc("number", "integer")) == []
    assert _details(doc("number", "integer"), doc("integer", "number")) == [
        "request body: property 'n' type number -> integer",
        "response 200 body: property 'n' type integer -> number",
    ]


def test_nullable_follows_direction() -> None:
    def doc(nullable: bool) -> dict[str, Any]:
        field = {"type": "string", "nullable": nullable}
        return _doc({"/o": {"post": _op(request=_obj(s=field), response=_obj(s=field))}})

    assert _details(doc(False), doc(True)) == [
        "response 200 body: property 's' type string -> string (nullable)"
    ]
    assert _details(doc(True), doc(False)) == [
        "request body: property 's' type string (nullable) -> string"
    ]


def test_response_field_removed_nested() -> None:
    old = _obj(
        id={"type": "string"}, customer=_obj(name={"type": "string"}, email={"type": "string"})
    )
    new = _obj(id={"type": "string"}, customer=_obj(name={"type": "string"}))
    risks = find_risks(
        _doc({"/o": {"get": _op(response=old)}}), _doc({"/o": {"get": _op(response=new)}})
    )
    assert _triples(risks) == [("/o", "GET", "response_field_removed")]
    assert risks[0]["detail"] == "response 200 body: property 'customer/email' removed"


def test_write_only_field_leaving_a_response_is_compatible() -> None:
    old = _obj(id={"type": "string"}, password={"type": "string", "writeOnly": True})
    new = _obj(id={"type": "string"})
    assert (
        find_risks(
            _doc({"/u": {"get": _op(response=old)}}), _doc({"/u": {"get": _op(response=new)}})
        )
        == []
    )


def test_new_response_field_is_compatible() -> None:
    old = _obj(id={"type": "string"})
    new = _obj(["id", "extra"], id={"type": "string"}, extra={"type": "integer"})
    assert (
        find_risks(
            _doc({"/o": {"get": _op(response=old)}}), _doc({"/o": {"get": _op(response=new)}})
        )
        == []
    )


def test_enum_narrowed_in_request_and_response() -> None:
    old_enum = {"type": "string", "enum": ["a", "b", "c"]}
    new_enum = {"type": "string", "enum": ["a", "c"]}
    old = _doc({"/e": {"post": _op(request=_obj(k=old_enum), response=_obj(k=old_enum))}})
    new = _doc({"/e": {"post": _op(request=_obj(k=new_enum), response=_obj(k=new_enum))}})
    assert _kinds(old, new) == ["enum_narrowed", "enum_narrowed"]
    assert _details(old, new) == [
        "request body: property 'k' enum values removed: 'b'",
        "response 200 body: property 'k' enum values removed: 'b'",
    ]


def test_enum_widened_in_request_is_compatible() -> None:
    old = _doc({"/e": {"post": _op(request=_obj(k={"type": "string", "enum": ["a"]}))}})
    new = _doc({"/e": {"post": _op(request=_obj(k={"type": "string", "enum": ["a", "b"]}))}})
    assert find_risks(old, new) == []


def test_enum_introduced_on_a_request_field_narrows_it() -> None:
    old = _doc({"/e": {"post": _op(request=_obj(k={"type": "string"}))}})
    new = _doc({"/e": {"post": _op(request=_obj(k={"type": "string", "enum": ["x", "y"]}))}})
    assert _details(old, new) == ["request body: property 'k' enum introduced: 'x', 'y'"]


def test_enum_values_compare_as_json() -> None:
    old = _doc({"/e": {"get": _op(params=[_query("v", type="integer", enum=[1, 2])])}})
    new = _doc({"/e": {"get": _op(params=[_query("v", type="integer", enum=[True, 2])])}})
    assert _details(old, new) == ["query parameter 'v': enum values removed: 1"]


def test_response_removed_only_for_success_codes() -> None:
    old_op = _op(response=_obj(id={"type": "string"}))
    old_op["responses"]["404"] = {"description": "missing"}
    new_op = {"responses": {"202": {"description": "accepted"}}}
    risks = find_risks(_doc({"/o": {"post": old_op}}), _doc({"/o": {"post": new_op}}))
    assert _triples(risks) == [("/o", "POST", "response_removed")]
    assert risks[0]["detail"] == "response 200 removed"


def test_response_media_type_removed_loses_its_fields() -> None:
    old = _doc({"/o": {"get": _op(response=_obj(id={"type": "string"}))}})
    new = _doc({"/o": {"get": {"responses": {"200": {"description": "ok"}}}}})
    assert _details(old, new) == ["response 200 body: property 'id' removed"]


def test_non_json_media_type_is_named() -> None:
    old = _doc(
        {"/o": {"post": {"requestBody": {"content": {"text/csv": {"schema": {"type": "string"}}}}}}}
    )
    new = _doc(
        {
            "/o": {
                "post": {"requestBody": {"content": {"text/csv": {"schema": {"type": "integer"}}}}}
            }
        }
    )
    assert _details(old, new) == ["request body (text/csv): type string -> integer"]


# --- $ref resolution, allOf, cycles ------------------------------------------------------------


def test_refs_are_resolved_through_components() -> None:
    schemas = {
        "Order": _obj(total={"$ref": "#/components/schemas/Money"}),
        "Alias": _ref("Order"),
        "Money": {"type": "number"},
    }
    old = _doc({"/o": {"get": _op(response=_ref("Alias"))}}, schemas)
    new = _doc(
        {"/o": {"get": _op(response=_ref("Alias"))}}, {**schemas, "Money": {"type": "string"}}
    )
    assert _details(old, new) == ["response 200 body: property 'total' type number -> string"]


def test_ref_and_equivalent_inline_schema_are_equal() -> None:
    schema = _obj(["id"], id={"type": "string"})
    old = _doc(
        {"/o": {"post": _op(request=_ref("Thing"), response=_ref("Thing"))}}, {"Thing": schema}
    )
    new = _doc({"/o": {"post": _op(request=copy.deepcopy(schema), response=copy.deepcopy(schema))}})
    assert find_risks(old, new) == []


def test_component_parameters_request_bodies_and_responses_are_resolved() -> None:
    def doc(limit_type: str, field_type: str) -> dict[str, Any]:
        base = _doc(
            {
                "/o": {
                    "post": {
                        "parameters": [_ref("Limit", "parameters")],
                        "requestBody": _ref("NewThing", "requestBodies"),
                        "responses": {"200": _ref("Thing", "responses")},
                    }
                }
            }
        )
        base["components"].update(
            {
                "parameters": {"Limit": _query("limit", type=limit_type)},
                "requestBodies": {
                    "NewThing": {"required": True, **_body(_obj(["n"], n={"type": "string"}))}
                },
                "responses": {
                    "Thing": {"description": "ok", **_body(_obj(f={"type": field_type}))}
                },
            }
        )
        return base

    assert find_risks(doc("integer", "string"), doc("integer", "string")) == []
    assert _kinds(doc("integer", "string"), doc("string", "boolean")) == [
        "parameter_type_changed",
        "type_changed",
    ]


def test_json_pointer_escapes_in_refs() -> None:
    schemas = {"a/b~c": _obj(x={"type": "string"})}
    target = {"$ref": "#/components/schemas/a~1b~0c"}
    old = _doc({"/o": {"get": _op(response=target)}}, schemas)
    new = _doc({"/o": {"get": _op(response=target)}}, {"a/b~c": _obj()})
    assert _details(old, new) == ["response 200 body: property 'x' removed"]


def test_all_of_members_are_merged() -> None:
    schemas = {"Base": _obj(["id"], id={"type": "string"}, tag={"type": "string"})}
    composed = {"allOf": [_ref("Base"), _obj(extra={"type": "integer"})]}
    slimmer = {"Base": _obj(["id"], id={"type": "string"})}
    old = _doc({"/o": {"get": _op(response=composed)}}, schemas)
    new = _doc({"/o": {"get": _op(response=composed)}}, slimmer)
    assert _details(old, new) == ["response 200 body: property 'tag' removed"]


def _tree(leaf_type: str) -> dict[str, Any]:
    node = _obj(value={"type": leaf_type}, children={"type": "array", "items": _ref("Node")})
    return _doc({"/t": {"put": _op(request=_ref("Node"), response=_ref("Node"))}}, {"Node": node})


def test_recursive_schemas_terminate() -> None:
    assert find_risks(_tree("string"), _tree("string")) == []
    assert _details(_tree("string"), _tree("integer")) == [
        "request body: property 'value' type string -> integer",
        "response 200 body: property 'value' type string -> integer",
    ]


def test_mutually_recursive_and_self_referencing_refs_terminate() -> None:
    schemas = {
        "A": _obj(b=_ref("B")),
        "B": _obj(a=_ref("A"), n={"type": "number"}),
        "Loop": _ref("Loop"),
        "Ping": _ref("Pong"),
        "Pong": _ref("Ping"),
        "Self": {"allOf": [_ref("Self"), _obj(s={"type": "string"})]},
    }
    paths = {
        "/c": {
            "get": _op(response=_obj(a=_ref("A"), l=_ref("Loop"), p=_ref("Ping"), s=_ref("Self")))
        }
    }
    old = _doc(paths, schemas)
    assert find_risks(old, copy.deepcopy(old)) == []
    new = copy.deepcopy(old)
    new["components"]["schemas"]["B"]["properties"]["n"] = {"type": "string"}
    new["components"]["schemas"]["Self"]["allOf"][1] = _obj()
    assert _details(old, new) == [
        "response 200 body: property 's/s' removed",
        "response 200 body: property 'a/b/n' type number -> string",
    ]


def test_dangling_and_external_refs_do_not_crash() -> None:
    old = _doc({"/o": {"get": _op(response={"$ref": "other.json#/X"})}})
    new = _doc({"/o": {"get": _op(response=_ref("Missing"))}})
    assert find_risks(old, new) == []


# --- scope -----------------------------------------------------------------------------------


def _scoped_docs() -> tuple[dict[str, Any], dict[str, Any]]:
    paths = ["/orders", "/orders/{id}", "/orders/{id}/lines", "/ordersx", "/users"]
    return _doc({p: {"get": _op()} for p in paths}), _doc({})


def test_scope_prefix_covers_whole_segments_only() -> None:
    old, new = _scoped_docs()
    paths = [r["path"] for r in find_risks(old, new, ["/orders"])]
    assert paths == ["/orders", "/orders/{id}", "/orders/{id}/lines"]
    assert [r["path"] for r in find_risks(old, new, ["/orders/"])] == paths
    assert [r["path"] for r in find_risks(old, new, ["/ordersx"])] == ["/ordersx"]
    assert [r["path"] for r in find_risks(old, new, ["/orders/{id}"])] == paths[1:]


def test_scope_none_empty_root_and_several_prefixes() -> None:
    old, new = _scoped_docs()
    everything = find_risks(old, new)
    assert len(everything) == 5
    assert find_risks(old, new, ["/"]) == everything
    assert find_risks(old, new, []) == []
    assert [r["path"] for r in find_risks(old, new, ["/users", "/ordersx"])] == [
        "/ordersx",
        "/users",
    ]


def test_results_are_sorted() -> None:
    old = _doc({"/b": {"get": _op(), "delete": _op()}, "/a": {"put": _op()}})
    risks = find_risks(old, _doc({}))
    keys = [(r["path"], r["method"], r["kind"], r["detail"]) for r in risks]
    assert keys == sorted(keys)


# --- properties --------------------------------------------------------------------------------

_NAMES = st.sampled_from(["id", "name", "total", "status", "lines", "note", "items"])
_TYPES = ["string", "integer", "number", "boolean"]


@st.composite
def _scalars(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(_TYPES))
    schema: dict[str, Any] = {"type": kind}
    if draw(st.booleans()):
        schema["nullable"] = True
    if kind == "string" and draw(st.booleans()):
        schema["enum"] = draw(
            st.lists(st.sampled_from("abcde"), min_size=1, max_size=3, unique=True)
        )
    return schema


@st.composite
def _objects(draw: st.DrawFn, children: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    props = draw(st.dictionaries(_NAMES, children, max_size=3))
    required = draw(st.lists(st.sampled_from(sorted(props)), unique=True)) if props else []
    return _obj(required, **props)


_SCHEMAS = st.recursive(
    _scalars(),
    lambda children: st.one_of(
        st.builds(lambda items: {"type": "array", "items": items}, children),
        _objects(children),
    ),
    max_leaves=10,
)


def _service(thing: dict[str, Any], param: dict[str, Any]) -> dict[str, Any]:
    op = _op(request=_ref("Thing"), response=_ref("Thing"), params=[_query("q", **param)])
    return _doc(
        {"/things": {"post": op, "put": _op(request=thing, response=thing)}}, {"Thing": thing}
    )


def _add_optional_everywhere(schema: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    if schema.get("type") == "array":
        return {**schema, "items": _add_optional_everywhere(schema["items"], extra)}
    if schema.get("type") != "object":
        return schema
    props = {k: _add_optional_everywhere(v, extra) for k, v in schema["properties"].items()}
    return {**schema, "properties": {**props, "added_field": extra}}


@settings(max_examples=150, deadline=None)
@given(thing=_SCHEMAS, param=_scalars())
def test_property_a_document_has_no_risks_against_itself(
    thing: dict[str, Any], param: dict[str, Any]
) -> None:
    doc = _service(thing, param)
    assert find_risks(doc, doc) == []
    assert find_risks(doc, copy.deepcopy(doc)) == []


@settings(max_examples=150, deadline=None)
@given(props=st.dictionaries(_NAMES, _SCHEMAS, max_size=3), extra=_SCHEMAS, param=_scalars())
def test_property_adding_an_optional_property_is_never_a_risk(
    props: dict[str, Any], extra: dict[str, Any], param: dict[str, Any]
) -> None:
    thing = _obj(sorted(props)[:1], **props)
    old = _service(thing, param)
    new = _service(_add_optional_everywhere(thing, extra), param)
    assert find_risks(old, new) == []
