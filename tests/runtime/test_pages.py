"""Reviewer pages for runs: list, start, one run, live part, and the levers.

The pages only translate HTTP; these tests check what a reviewer sees and what is stored
afterwards, that another tenant's run is indistinguishable from no run at all, and that
viewers cannot change anything.
"""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from audit.journal import run_stream
from audit.models import JournalEntry
from runtime.errors import InvalidParams
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Run, RunStatus, Tenant
from runtime.pages.display import summarise
from runtime.pages.runs import parse_json
from tests.audit.tamper import tampering
from tests.conftest import Persona

HX = {"HTTP_HX_REQUEST": "true"}


def login(client: Client, persona: Persona) -> Client:
    client.force_login(persona.user)
    return client


def make_run(tenant: Tenant, graph: str = "chain", goal: Any = None, **kwargs: Any) -> Run:
    return create_run(tenant, graph, {"steps": 2} if goal is None else goal, actor="t", **kwargs)


def messages_of(response: Any) -> list[str]:
    return [str(m) for m in response.context["messages"]]


def make_due(run: Run) -> None:
    """A retrying run's backoff is over (tests move data, not clocks)."""
    Run.objects.filter(pk=run.pk).update(wake_at=timezone.now() - timedelta(seconds=1))


# --- the list -------------------------------------------------------------------------------


def test_list_shows_only_own_tenants_runs(
    client: Client, reviewer_a: Persona, tenant_b: Tenant
) -> None:
    mine = make_run(reviewer_a.tenant, thread_id="thread-of-acme")
    theirs = make_run(tenant_b, thread_id="thread-of-globex")
    page = login(client, reviewer_a).get(reverse("runs"))
    assert page.status_code == 200
    assert str(mine.run_id)[:8].encode() in page.content
    assert b"thread-of-acme" in page.content
    assert str(theirs.run_id)[:8].encode() not in page.content
    assert b"thread-of-globex" not in page.content
    assert [r.run_id for r in page.context["page_obj"]] == [mine.run_id]


def test_list_filters_newest_first_and_refuses_unknown_status(
    client: Client, reviewer_a: Persona
) -> None:
    first = make_run(reviewer_a.tenant, thread_id="t-1")
    second = make_run(reviewer_a.tenant, "asker", {}, thread_id="t-2")
    advance_run(first.run_id, "w1")  # completed
    login(client, reviewer_a)

    def listed(**params: str) -> list[uuid.UUID]:
        page = client.get(reverse("runs"), params)
        assert page.status_code == 200
        return [r.run_id for r in page.context["page_obj"]]

    assert listed() == [second.run_id, first.run_id]
    assert listed(status="completed") == [first.run_id]
    # A status word that does not exist is a 400 naming the filter, as the API's 422 does
    # (issue 16, L1); the filter form's empty "any status" still lists all.
    refused = client.get(reverse("runs"), {"status": "no-such-status"})
    assert refused.status_code == 400 and b"status" in refused.content
    assert listed(status="") == [second.run_id, first.run_id]
    assert listed(graph="asker") == [second.run_id]
    assert listed(thread_id="t-1") == [first.run_id]
    assert listed(graph="chain", status="queued") == []


def test_list_paginates_by_fifty(client: Client, reviewer_a: Persona) -> None:
    for _ in range(51):
        make_run(reviewer_a.tenant)
    login(client, reviewer_a)
    first = client.get(reverse("runs"))
    assert len(first.context["page_obj"]) == 50 and b"Older" in first.content
    second = client.get(reverse("runs"), {"page": 2})
    assert len(second.context["page_obj"]) == 1
    assert client.get(reverse("runs"), {"page": "zzz"}).status_code == 200


def test_list_query_count_does_not_grow_with_runs(client: Client, reviewer_a: Persona) -> None:
    login(client, reviewer_a)

    def queries_for(total: int) -> int:
        while Run.objects.count() < total:
            make_run(reviewer_a.tenant)
        with CaptureQueriesContext(connection) as captured:
            page = client.get(reverse("runs"))
        assert page.status_code == 200 and len(page.context["page_obj"]) == total
        return len(captured)

    assert queries_for(3) == queries_for(30)


def test_a_page_reads_the_user_and_the_memberships_once(
    client: Client, reviewer_a: Persona, tenant_b: Tenant
) -> None:
    """Each page read the signed-in user twice (the membership's user, again) and the
    memberships twice (the tenant switcher's list, again): two statements of every page's
    ten or so that told nothing new. The switcher still lists both tenants."""
    from runtime.models import Membership, Role

    Membership.objects.create(tenant=tenant_b, user=reviewer_a.user, role=Role.VIEWER)
    login(client, reviewer_a)
    for url in (reverse("inbox"), reverse("runs"), reverse("run", args=[uuid.uuid4()])):
        with CaptureQueriesContext(connection) as captured:
            page = client.get(url)
        assert page.status_code in (200, 404), url
        reads = [q["sql"] for q in captured if " FROM " in q["sql"]]
        tables = [sql.split(" FROM ", 1)[1].split()[0] for sql in reads]
        assert tables.count('"auth_user"') == 1, (url, tables)
        assert tables.count('"runtime_membership"') == 1, (url, tables)
        switcher = b"switch tenant" if page.status_code == 404 else tenant_b.name.encode()
        assert switcher in page.content, url


def test_user_without_tenant_gets_a_friendly_page(client: Client, db: None) -> None:
    user = get_user_model().objects.create_user(username="nomad", password="pw-nomad")
    client.force_login(user)
    for url in (reverse("runs"), reverse("run", args=[uuid.uuid4()])):
        page = client.get(url)
        assert page.status_code == 200
        assert b"not a member of any active tenant" in page.content
    assert client.post(reverse("runs"), {"graph": "chain", "goal": "{}"}).status_code == 403
    assert Run.objects.count() == 0


def test_pages_need_login(client: Client, db: None) -> None:
    response = client.get(reverse("runs"))
    assert response.status_code == 302 and response["Location"].startswith(reverse("login"))


def test_agents_do_not_use_pages(client: Client, agent_a: Persona) -> None:
    assert login(client, agent_a).get(reverse("runs")).status_code == 403


# --- isolation ------------------------------------------------------------------------------


def test_other_tenants_run_is_not_found_like_a_missing_one(
    client: Client, reviewer_a: Persona, outsider_b: Persona
) -> None:
    secret = make_run(
        reviewer_a.tenant, goal={"steps": 2, "secret": "acme-plans"}, thread_id="acme-thread"
    )
    login(client, outsider_b)
    missing = uuid.uuid4()
    for name in ("run", "run-live"):
        foreign = client.get(reverse(name, args=[secret.run_id]), **HX)
        absent = client.get(reverse(name, args=[missing]), **HX)
        assert foreign.status_code == absent.status_code == 404
        assert foreign.content == absent.content
        assert b"acme" not in foreign.content.lower()
    for name in ("run-cancel", "run-resume", "run-input", "run-revise"):
        response = client.post(
            reverse(name, args=[secret.run_id]),
            {
                "goal": "{}",
                "input": "{}",
                "expected_rev": "0",
                "expected_goal_rev": "1",
                "reason": "x",
            },
        )
        assert response.status_code == 404
    secret.refresh_from_db()
    assert secret.status == RunStatus.QUEUED and secret.goal_rev == 1


# --- starting a run -------------------------------------------------------------------------


def test_start_form_is_prefilled_with_the_api_review_goal(
    client: Client, reviewer_a: Persona
) -> None:
    page = login(client, reviewer_a).get(reverse("runs"))
    assert page.context["form"]["graph"] == "api-review"
    assert json.loads(page.context["form"]["goal"])["old_spec"] == "shop-v1"
    assert b'name="goal"' in page.content and b"chain@1" in page.content


def test_starting_a_run_then_watching_it_complete(client: Client, reviewer_a: Persona) -> None:
    login(client, reviewer_a)
    response = client.post(
        reverse("runs"), {"graph": "chain", "goal": '{"steps": 2}', "thread_id": "mine"}
    )
    run = Run.objects.get()
    assert response.status_code == 302
    assert response["Location"] == reverse("run", args=[run.run_id])
    assert run.tenant == reviewer_a.tenant and run.thread_id == "mine"
    assert run.goal == {"steps": 2} and run.created_by == "user:alice"

    assert advance_run(run.run_id, "w1").outcome == "completed"
    page = client.get(response["Location"])
    assert page.status_code == 200
    text = page.content.decode()
    assert '<span class="badge completed">completed</span>' in text
    for event in ("run_created", "lease_taken", "step_committed"):
        assert event in text
    assert "chain verified" in text
    state = json.loads(page.context["state_json"])  # the latest checkpoint's, decoded
    assert state == {"i": 2, "answers": ["thought 1", "thought 2"]}
    assert "&quot;i&quot;: 2" in text
    assert "hx-trigger" not in text  # terminal: nothing to poll
    assert "Cancel run" not in text  # no levers on a finished run


def test_start_without_thread_id_gets_a_fresh_one(client: Client, reviewer_a: Persona) -> None:
    login(client, reviewer_a).post(reverse("runs"), {"graph": "chain", "goal": "{}"})
    assert Run.objects.get().thread_id


@pytest.mark.parametrize(
    ("form", "error"),
    [
        ({"graph": "chain", "goal": '{"steps": 2'}, "goal is not valid JSON"),
        ({"graph": "chain", "goal": '{"a": 1, "a": 2}'}, "duplicate key"),
        ({"graph": "chain", "goal": '{"a": NaN}'}, "NaN is not JSON"),
        # Past Python's parser (RecursionError: it was a 500) and just within it.
        ({"graph": "chain", "goal": "[" * 100_000 + "]" * 100_000}, "nested deeper than 64 levels"),
        ({"graph": "chain", "goal": "[" * 5_000 + "]" * 5_000}, "nested deeper than 64 levels"),
        ({"graph": "chain", "goal": "[" * 900 + "]" * 900}, "nested deeper than 64 levels"),
        ({"graph": "chain", "goal": '{"a":' * 65 + "1" + "}" * 65}, "nested deeper than 64"),
        ({"graph": "no-such-graph", "goal": "{}"}, "no graph named"),
        ({"graph": "chain", "goal": "{}", "thread_id": "x" * 201}, "no more than 200"),
    ],
)
def test_bad_start_is_shown_and_creates_nothing(
    client: Client, reviewer_a: Persona, form: dict[str, str], error: str
) -> None:
    page = login(client, reviewer_a).post(reverse("runs"), form)
    assert page.status_code == 422
    assert error in page.content.decode()
    assert page.context["form"]["goal"] == form["goal"]  # what was typed is kept
    assert Run.objects.count() == 0


def test_viewer_may_look_but_not_start(client: Client, viewer_a: Persona) -> None:
    run = make_run(viewer_a.tenant)
    login(client, viewer_a)
    listing = client.get(reverse("runs"))
    assert listing.status_code == 200 and b"Start a run" not in listing.content
    assert client.post(reverse("runs"), {"graph": "chain", "goal": "{}"}).status_code == 403
    page = client.get(reverse("run", args=[run.run_id]))
    assert page.status_code == 200 and b"Cancel run" not in page.content
    assert Run.objects.count() == 1


def test_viewer_cannot_pull_levers(client: Client, viewer_a: Persona) -> None:
    run = make_run(viewer_a.tenant)
    login(client, viewer_a)
    data = {
        "reason": "x",
        "goal": "{}",
        "input": "{}",
        "expected_rev": "0",
        "expected_goal_rev": "1",
    }
    for name in ("run-cancel", "run-resume", "run-input", "run-revise"):
        assert client.post(reverse(name, args=[run.run_id]), data).status_code == 403
    run.refresh_from_db()
    assert run.status == RunStatus.QUEUED and run.goal_rev == 1


# --- the levers -----------------------------------------------------------------------------


def test_cancel(client: Client, reviewer_a: Persona) -> None:
    run = make_run(reviewer_a.tenant)
    login(client, reviewer_a)
    page = client.post(
        reverse("run-cancel", args=[run.run_id]), {"reason": "wrong repo"}, follow=True
    )
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED
    assert "Run cancelled." in messages_of(page)
    entry = JournalEntry.objects.get(stream=run_stream(run.run_id), type="cancelled")
    assert entry.payload["reason"] == "wrong repo" and entry.actor == "user:alice"

    again = client.post(reverse("run-cancel", args=[run.run_id]), {"reason": "twice"}, follow=True)
    assert again.status_code == 200
    assert "the run is cancelled" in messages_of(again)


def test_resume_after_escalation(client: Client, reviewer_a: Persona) -> None:
    run = make_run(reviewer_a.tenant, "flaky", {"fail_times": 3})
    for _ in range(3):
        advance_run(run.run_id, "w1")
        make_due(run)
    run.refresh_from_db()
    assert run.status == RunStatus.NEEDS_ATTENTION
    login(client, reviewer_a)
    page = client.get(reverse("run", args=[run.run_id]))
    assert b"Needs attention" in page.content and b">Resume</button>" in page.content

    done = client.post(
        reverse("run-resume", args=[run.run_id]),
        {"expected_rev": str(run.checkpoint_rev)},
        follow=True,
    )
    run.refresh_from_db()
    assert run.status == RunStatus.QUEUED and run.attention_reason == ""
    assert "Resumed: the run is queued." in messages_of(done)
    assert advance_run(run.run_id, "w1").outcome == "completed"

    finished = client.post(reverse("run-resume", args=[run.run_id]), follow=True)
    assert "already completed" in " ".join(messages_of(finished))


def test_provide_input_then_complete(client: Client, reviewer_a: Persona) -> None:
    run = make_run(reviewer_a.tenant, "asker", {})
    advance_run(run.run_id, "w1")
    run.refresh_from_db()
    assert run.status == RunStatus.WAITING_INPUT
    login(client, reviewer_a)
    page = client.get(reverse("run", args=[run.run_id]))
    assert b"What is the ticket title?" in page.content
    assert f'name="expected_rev" value="{run.checkpoint_rev}"'.encode() in page.content

    stale = client.post(
        reverse("run-input", args=[run.run_id]),
        {"input": '{"title": "x"}', "expected_rev": str(run.checkpoint_rev + 7)},
        follow=True,
    )
    assert any("checkpoint_rev is" in m for m in messages_of(stale))
    run.refresh_from_db()
    assert run.status == RunStatus.WAITING_INPUT and run.pending_input is None

    sent = client.post(
        reverse("run-input", args=[run.run_id]),
        {"input": '{"title": "x"}', "expected_rev": str(run.checkpoint_rev)},
        follow=True,
    )
    assert "Input delivered: the run is queued to continue." in messages_of(sent)
    assert advance_run(run.run_id, "w1").outcome == "completed"
    final = client.get(reverse("run", args=[run.run_id]))
    assert (
        b"&quot;title&quot;: &quot;x&quot;" in final.content and b"input_received" in final.content
    )


def test_bad_input_json_keeps_the_draft(client: Client, reviewer_a: Persona) -> None:
    run = make_run(reviewer_a.tenant, "asker", {})
    advance_run(run.run_id, "w1")
    run.refresh_from_db()
    page = login(client, reviewer_a).post(
        reverse("run-input", args=[run.run_id]),
        {"input": '{"title": ', "expected_rev": str(run.checkpoint_rev)},
    )
    assert page.status_code == 422
    assert b"input is not valid JSON" in page.content
    assert b"{&quot;title&quot;: </textarea>" in page.content
    run.refresh_from_db()
    assert run.status == RunStatus.WAITING_INPUT


def test_revise_goal(client: Client, reviewer_a: Persona) -> None:
    run = make_run(reviewer_a.tenant)
    login(client, reviewer_a)
    page = client.get(reverse("run", args=[run.run_id]))
    assert b'name="expected_goal_rev" value="1"' in page.content
    assert b"&quot;steps&quot;: 2" in page.content  # the textarea holds the current goal

    stale = client.post(
        reverse("run-revise", args=[run.run_id]),
        {"goal": '{"steps": 1}', "expected_goal_rev": "5"},
        follow=True,
    )
    assert any("goal_rev is 1" in m for m in messages_of(stale))
    run.refresh_from_db()
    assert run.goal_rev == 1

    bad = client.post(
        reverse("run-revise", args=[run.run_id]), {"goal": "{steps: 1}", "expected_goal_rev": "1"}
    )
    assert bad.status_code == 422 and b"goal is not valid JSON" in bad.content

    done = client.post(
        reverse("run-revise", args=[run.run_id]),
        {"goal": '{"steps": 1}', "expected_goal_rev": "1"},
        follow=True,
    )
    run.refresh_from_db()
    assert run.goal_rev == 2 and run.goal == {"steps": 1}
    assert "Goal revised: now revision 2." in messages_of(done)
    assert advance_run(run.run_id, "w1").outcome == "completed"


def test_missing_expected_rev_is_a_message_not_a_500(client: Client, reviewer_a: Persona) -> None:
    run = make_run(reviewer_a.tenant)
    page = login(client, reviewer_a).post(
        reverse("run-revise", args=[run.run_id]), {"goal": "{}"}, follow=True
    )
    assert page.status_code == 200
    assert "expected_goal_rev is missing or not a number" in messages_of(page)


@pytest.mark.parametrize("name", ["run-cancel", "run-resume", "run-input", "run-revise"])
def test_levers_refuse_get(client: Client, reviewer_a: Persona, name: str) -> None:
    run = make_run(reviewer_a.tenant)
    assert login(client, reviewer_a).get(reverse(name, args=[run.run_id])).status_code == 405
    run.refresh_from_db()
    assert run.status == RunStatus.QUEUED


def test_pages_refuse_other_methods(client: Client, reviewer_a: Persona) -> None:
    run = make_run(reviewer_a.tenant)
    login(client, reviewer_a)
    assert client.post(reverse("run", args=[run.run_id])).status_code == 405
    assert client.post(reverse("run-live", args=[run.run_id])).status_code == 405
    assert client.delete(reverse("runs")).status_code == 405


# --- live updates ---------------------------------------------------------------------------


def test_live_part_polls_until_the_run_ends(client: Client, reviewer_a: Persona) -> None:
    run = make_run(reviewer_a.tenant)
    login(client, reviewer_a)
    page = client.get(reverse("run", args=[run.run_id]))
    live_url = page.context["live_url"]
    assert f'hx-get="{live_url.replace("&", "&amp;")}"'.encode() in page.content
    # Re-fetched on each event of the run's stream (live.js), polled every 2 s without it.
    assert b'hx-trigger="every 2s, live"' in page.content
    stream = reverse("api-events", args=[run.run_id]) + "?stream=1"
    assert f'data-live-stream="{stream}"'.encode() in page.content

    running = client.get(live_url, **HX)
    assert running.status_code == 200
    assert b'id="run-live"' in running.content and b"<html" not in running.content
    assert b'hx-trigger="every 2s, live"' in running.content
    assert b"has moved since" not in running.content
    assert "HX-Request" in running["Vary"]

    advance_run(run.run_id, "w1")
    ended = client.get(live_url, **HX)
    assert b"hx-trigger" not in ended.content and b"data-live-stream" not in ended.content
    assert b'<span class="badge completed">completed</span>' in ended.content
    assert b"has moved since" in ended.content  # the page's forms are stale: say so

    direct = client.get(live_url)  # opened in a tab, not by htmx: the whole page
    assert b"<html" in direct.content and b'id="run-live"' in direct.content


def test_pages_have_no_inline_scripts_or_handlers(client: Client, reviewer_a: Persona) -> None:
    """A strict CSP comes later; nothing here may depend on inline code."""
    run = make_run(reviewer_a.tenant, "asker", {})
    advance_run(run.run_id, "w1")
    login(client, reviewer_a)
    for url in (reverse("runs"), reverse("run", args=[run.run_id])):
        text = client.get(url).content.decode().lower()
        assert "<script>" not in text and " onclick=" not in text and " onsubmit=" not in text
        assert " style=" not in text


def test_broken_chain_is_shown(client: Client, reviewer_a: Persona) -> None:
    run = make_run(reviewer_a.tenant)
    advance_run(run.run_id, "w1")
    entry = JournalEntry.objects.get(stream=run_stream(run.run_id), seq=2)
    original = entry.actor
    with tampering() as cursor:
        cursor.execute(
            "UPDATE audit_journalentry SET actor = %s WHERE id = %s", ["mallory", entry.pk]
        )
    try:
        page = login(client, reviewer_a).get(reverse("run", args=[run.run_id]))
        assert b"chain broken at seq 2" in page.content
        assert b"chain verified" not in page.content
    finally:
        with tampering() as cursor:
            cursor.execute(
                "UPDATE audit_journalentry SET actor = %s WHERE id = %s", [original, entry.pk]
            )


# --- small translations ---------------------------------------------------------------------


def test_parse_json_is_strict() -> None:
    assert parse_json('{"a": [1, 2.5, null]}', "goal") == {"a": [1, 2.5, None]}
    for text in ('{"a": 1, "a": 1}', "[Infinity]", "-Infinity", "", "{'a': 1}"):
        with pytest.raises(InvalidParams, match="goal"):
            parse_json(text, "goal")


def test_summary_is_one_short_line() -> None:
    line = summarise(
        {
            "digest": "f" * 64,
            "status": "running",
            "step": "tick",
            "rev": 3,
            "goal": {"big": "x" * 500},
            "withdrawn_actions": ["a", "b"],
        }
    )
    assert line == "status=running · step=tick · rev=3 · withdrawn_actions=(2 items)"
    assert len(summarise({"error": "e" * 1000, "reason": "r" * 1000})) <= 160
