"""A guessed id of another tenant is logged for operators (ASVS 16.3.2, TEST-MATRIX E1),
while the caller's answer stays the 404 a missing id gets."""

from __future__ import annotations

import logging
import uuid

import pytest

from tests.api import get, new_run
from tests.conftest import Persona


def test_another_tenants_id_is_logged_and_a_missing_one_is_not(
    agent_a: Persona, agent_b: Persona, caplog: pytest.LogCaptureFixture
) -> None:
    theirs = new_run(agent_b.api())["run_id"]
    missing = str(uuid.uuid4())
    with caplog.at_level(logging.WARNING, logger="holdpoint.security"):
        foreign = get(agent_a.api(), f"runs/{theirs}/")
        absent = get(agent_a.api(), f"runs/{missing}/")
    assert (foreign.status_code, foreign.content) == (absent.status_code, absent.content)
    assert foreign.status_code == 404
    warnings = [r.getMessage() for r in caplog.records if r.name == "holdpoint.security"]
    assert len(warnings) == 1, warnings
    assert theirs in warnings[0] and "agent:agent-a" in warnings[0]
    assert agent_a.tenant.slug in warnings[0]


def test_a_malformed_id_is_not_logged_as_an_attempt(
    agent_a: Persona, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="holdpoint.security"):
        assert get(agent_a.api(), "runs/not-a-uuid/").status_code == 404
    assert not [r for r in caplog.records if r.name == "holdpoint.security"]
