"""Ids given to the client name one object each, whatever they hold (live_server)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.core.cache import caches

import holdpoint_client.errors as errors
from holdpoint_client import Client
from runtime.models import Run as RunRow
from tests.conftest import Persona

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def api(live_server: Any, agent_a: Persona) -> Iterator[Client]:
    caches["default"].clear()  # request rates outlive each test's database
    with Client(live_server.url, agent_a.token or "", backoff=0.01) as client:
        yield client


def test_an_id_holding_path_characters_reaches_no_other_endpoint(api: Client) -> None:
    """Ids went into the URL as they were: `dispatch("../runs/<id>/cancel/#", fence)` was a
    POST to runs/<id>/cancel/ — the run cancelled by a call that dispatches an action — and
    `get_run("../actions")` read the action list and failed with KeyError: 'run_id'. Now
    each id is one quoted path segment: it names no object (404), and an empty id, "." or
    ".." is refused before anything is sent."""
    run = api.create_run("api-review", {}, external=True)
    grant = api.lease(run.run_id, "agent-1", 30)

    with pytest.raises(errors.NotFound):
        api.dispatch(f"../runs/{run.run_id}/cancel/#", grant.fence)
    with pytest.raises(errors.NotFound):
        api.get_run("../actions")
    with pytest.raises(errors.NotFound):
        api.get_approval("x?status=pending")
    for empty in ("", ".", ".."):
        with pytest.raises(ValueError, match="not an id"):
            api.get_action(empty)

    assert RunRow.objects.get(pk=run.run_id).status == "running"
