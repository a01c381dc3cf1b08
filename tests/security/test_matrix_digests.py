"""The matrix's own digests: what they must see change, and the one thing they must not.

`matrix.tenant_state` decides whether a probe touched a tenant's rows. A caller's own API
token records its use at most once a minute (`TOUCH_EVERY`); a probe whose before and
after straddled that minute used to read as "the caller's tenant changed" (a CI flake on a
slow machine, stop 50). The digest now skips that column as `db_state` already did, and
still sees every real write, to that token included.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine

from runtime.auth import revoke_token
from runtime.models import AgentToken
from runtime.models.tokens import TOUCH_EVERY
from tests.conftest import Persona
from tests.security import matrix
from tests.security.conftest import token_client

pytestmark = pytest.mark.django_db


def test_the_callers_own_token_use_is_not_a_change_to_its_tenant(agent_a: Persona) -> None:
    client = token_client(agent_a)
    with time_machine.travel("2026-12-07 12:00:00+00:00", tick=False) as clock:
        assert client.get("/api/v1/runs/").status_code == 200
        before = matrix.tenant_state(agent_a.tenant.pk)
        clock.shift(TOUCH_EVERY + timedelta(seconds=1))
        refused = client.post("/api/v1/tools/", {"name": "x"}, format="json")
        assert refused.status_code == 403
    token = AgentToken.objects.get(tenant=agent_a.tenant)
    assert token.last_used_at is not None
    assert token.last_used_at.isoformat().startswith("2026-12-07T12:01:01")  # it was written
    assert matrix.tenant_state(agent_a.tenant.pk) == before


def test_a_real_write_to_the_same_token_is_still_a_change(agent_a: Persona) -> None:
    before = matrix.tenant_state(agent_a.tenant.pk)
    assert revoke_token(AgentToken.objects.get(tenant=agent_a.tenant), actor="test")
    after = matrix.tenant_state(agent_a.tenant.pk)
    assert after["runtime.AgentToken"] != before["runtime.AgentToken"]
    # the revocation is journalled in the tenant's stream, whose head moves
    changed = ["audit.JournalEntry", "audit.StreamHead", "runtime.AgentToken"]
    assert matrix.changed_tables(before, after) == changed
