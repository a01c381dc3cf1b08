"""The run page's State panel refreshes with the live header, and `waiting_for` reads as a
sentence with a link to what is awaited (issue 20).

The live part (`run-live`, polled by htmx every 2 s) sends the State panel again, out of
band (`hx-swap-oob`), exactly when the checkpoint moved past the one the page shows; a quiet
poll does not ship the state at all.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from html import unescape
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Run, RunStatus
from runtime.pages.runs import waiting_of
from tests.conftest import Persona

HX = {"HTTP_HX_REQUEST": "true"}


def state_panel(html: str) -> str | None:
    found = re.search(r'<section class="card run-state"[^>]*>.*?</section>', html, re.S)
    return found.group(0) if found else None


def test_the_state_panel_is_refreshed_with_the_header_when_the_checkpoint_moves(
    client: Client, reviewer_a: Persona
) -> None:
    run = create_run(reviewer_a.tenant, "chain", {"steps": 2}, actor="user:alice")
    client.force_login(reviewer_a.user)
    page = client.get(reverse("run", args=[run.run_id])).content.decode()
    assert "No checkpoint yet" in (state_panel(page) or "")
    live_url = unescape(re.search(r'id="run-live"[^>]*hx-get="([^"]+)"', page).group(1))  # type: ignore[union-attr]

    quiet = client.get(live_url, **HX).content.decode()
    assert state_panel(quiet) is None  # nothing moved: the state is not sent again

    advance_run(run.run_id, "w1")
    run.refresh_from_db()
    moved = client.get(live_url, **HX).content.decode()
    panel = state_panel(moved)
    assert panel is not None and 'hx-swap-oob="true"' in panel
    assert f"As of checkpoint {run.checkpoint_rev}." in panel and "No checkpoint yet" not in panel
    # The fragment's next poll carries the new checkpoint: quiet again.
    next_url = unescape(re.search(r'id="run-live"[^>]*hx-get="([^"]+)"', moved).group(1))  # type: ignore[union-attr]
    assert f"state={run.checkpoint_rev}" in next_url
    assert state_panel(client.get(next_url, **HX).content.decode()) is None


def test_waiting_for_input_is_a_sentence_pointing_at_the_form(
    client: Client, reviewer_a: Persona
) -> None:
    run = create_run(reviewer_a.tenant, "asker", {}, actor="user:alice")
    advance_run(run.run_id, "w1")
    run.refresh_from_db()
    assert run.status == RunStatus.WAITING_INPUT
    client.force_login(reviewer_a.user)
    html = client.get(reverse("run", args=[run.run_id])).content.decode()
    waiting = re.search(r'<p class="waiting-for" id="waiting-for">(.*?)</p>', html, re.S)
    assert waiting is not None
    text = " ".join(unescape(re.sub(r"<[^>]+>", " ", waiting.group(1))).split())
    assert text.startswith("Waiting for input:")
    assert 'href="#input-data"' in waiting.group(1)
    assert "{&quot;kind&quot;" not in html and '"kind": "input"' not in html  # no raw JSON


@pytest.mark.django_db
def test_waiting_for_a_timer_or_a_reconciliation_in_words() -> None:
    until = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    timer = waiting_of(Run(waiting_for={"kind": "timer", "until": until.isoformat()}))
    assert timer is not None and timer.sentence.startswith("Waiting for a timer")
    assert timer.until == until and timer.link_url == ""
    action_id = "8d7cf2f6-3bb7-4a7c-8f0e-6b1c1b2b6c11"
    settle = waiting_of(
        Run(waiting_for={"kind": "reconciliation", "action_id": action_id, "tool": "tasks.create"})
    )
    assert settle is not None and "settle whether tasks.create happened" in settle.sentence
    assert settle.link_url == reverse("reconcile-detail", args=[action_id])
    assert waiting_of(Run(waiting_for=None)) is None
    odd: Any = waiting_of(Run(waiting_for={"kind": "approval", "action_id": "not-a-uuid"}))
    assert odd is not None and odd.link_url == ""
