"""Any JSON state reads back exactly as written, including objects that use the encoder's
own keys (`$ref`, `$chunks`, `$literal`) — through the worker's real write and read path
(encode, checkpoint, artifacts; load, resolve) and the API's `?inline=1` (issue 16, L4).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.urls import reverse
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from audit.canonical import MAX_SAFE_INT, canonical, canonical_bytes
from runtime.artifacts import resolve
from runtime.executor import advance_run
from runtime.lifecycle import create_run, provide_input
from runtime.models import Artifact, Checkpoint, Run, Tenant
from tests.conftest import Persona
from tests.runtime import failing  # noqa: F401  (registers the echo graph)

ZEROS = "0" * 64
RESERVED = ["$ref", "$chunks", "$literal", "n"]


def _round_trip(tenant: Tenant, state: dict[str, Any]) -> tuple[Run, Any, Any]:
    """What the checkpoint after the write reads back as, and what the next step — after a
    fresh load from that checkpoint — saw."""
    run = create_run(tenant, "echo", {"state": state}, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    run.refresh_from_db()
    written = Checkpoint.objects.get(run=run, rev=run.checkpoint_rev)
    stored = resolve(tenant.pk, written.state)
    provide_input(run, {}, expected_rev=run.checkpoint_rev, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    run.refresh_from_db()
    final = resolve(tenant.pk, Checkpoint.objects.get(run=run, rev=run.checkpoint_rev).state)
    return run, stored, final["seen"]


def _inline(persona: Persona, run: Run, rev: int) -> Any:
    url = reverse("api-checkpoint", args=[run.run_id, rev]) + "?inline=1"
    response = persona.api().get(url)
    assert response.status_code == 200, response.content
    return response.json()["state"]


@pytest.mark.parametrize(
    "state",
    [
        {"a": {"$literal": {"x": 1}}},
        {"b": {"$ref": ZEROS}},
        {"c": {"$chunks": [{"$ref": ZEROS}], "n": 1}},
        {"d": {"$literal": 5}, "e": [{"$ref": "x", "other": True}]},
        {"f": {"$literal": {"$literal": {"$ref": ZEROS}}}, "g": ["y" * 600] * 40},
    ],
)
def test_reserved_keys_read_back_as_written(
    state: dict[str, Any], tenant_a: Tenant, reviewer_a: Persona
) -> None:
    run, stored, seen = _round_trip(tenant_a, state)
    assert stored == state and seen == state
    waited = run.checkpoint_rev - 1  # the checkpoint the wait wrote
    assert _inline(reviewer_a, run, waited) == state


@pytest.mark.tampers_journal  # a row written by hand, as before: no step journalled it
def test_a_checkpoint_stored_in_the_earlier_form_still_reads(
    tenant_a: Tenant, reviewer_a: Persona
) -> None:
    """Before, a user object with `$ref` was boxed into an artifact of its own; such rows
    exist and must read as they were written (and not answer 500 inline)."""
    run = create_run(tenant_a, "echo", {"state": {}}, actor="t")
    boxed = canonical({"$literal": {"$ref": ZEROS}}).decode()
    digest = __import__("hashlib").sha256(boxed.encode()).hexdigest()
    Artifact.objects.create(tenant=tenant_a, digest=digest, content=boxed, size=len(boxed))
    Checkpoint.objects.create(
        run=run,
        tenant=tenant_a,
        rev=1,
        goal_rev=1,
        status="waiting_input",
        state={"b": {"$ref": digest}, "plain": {"k": [1, 2]}},
        created_by="test:earlier-form",
        fence=1,
        digest="0" * 64,
    )
    expected = {"b": {"$ref": ZEROS}, "plain": {"k": [1, 2]}}
    assert resolve(tenant_a.pk, Checkpoint.objects.get(run=run, rev=1).state) == expected
    assert _inline(reviewer_a, run, 1) == expected


_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"))
_keys = st.sampled_from(RESERVED) | _text
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-MAX_SAFE_INT, MAX_SAFE_INT)
    | st.floats(allow_nan=False, allow_infinity=False, min_value=-1e15, max_value=1e15)
    | _text
    | st.just(ZEROS)
    | st.just("z" * 600)  # long enough to become an artifact
)
_json = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=40)  # over 32 items: chunked
        | st.dictionaries(_keys, inner, max_size=4)
    ),
    max_leaves=60,
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(state=st.dictionaries(_keys, _json, max_size=5))
def test_any_json_state_round_trips_exactly(
    state: dict[str, Any], tenant_a: Tenant, reviewer_a: Persona
) -> None:
    written = canonical_bytes(state)
    run, stored, seen = _round_trip(tenant_a, state)
    assert canonical_bytes(stored) == written and stored == state
    assert canonical_bytes(seen) == written and seen == state
    inline = _inline(reviewer_a, run, run.checkpoint_rev - 1)
    assert canonical_bytes(inline) == written, json.dumps(state)[:500]
