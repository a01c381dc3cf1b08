"""B6: a model-based test of the executor protocol over the API.

Two agent "processes" of one tenant (two API clients with the same token) drive two runs
through leases, heartbeats, lease expiry (the data is moved, not the clock), checkpoints
with expected_rev, prepare / dispatch / outcome of actions (also as one executor step: the
newest action sent and its outcome reported; and the last report sent again, as it was or
changed), goal revisions (by an agent or a reviewer) and cancellation, in an order
Hypothesis chooses. Every call's answer is predicted
from the database state just before it — so a stale fence must get 409 stale_fence on every
write — and after every step the invariants are checked against the database and the
journal:

- fences taken are strictly increasing per run (a take is the run's fence + 1, and a
  release moves the fence on by one, so the released holder's writes are stale);
- every checkpoint, prepared action and `sent` mark carries the fence that owned the run
  when it was written (no write under a stale fence landed);
- checkpoint revs are 1..checkpoint_rev, contiguous and unique;
- no action prepared under an old goal_rev is marked `sent` after the revision that left it;
- a confirmed action always has an external_id;
- each run's journal chain verifies.

A finished run (cancelled by the reviewer) refuses every further write of its executor.
A client's retry of a call whose answer it lost is answered as the first was: a release
repeated by the holder it released (nothing leased the run since) is 200, and so is an
outcome report repeated — the same fence, outcome, external id and result — whatever
happened to its action since, unless it was sent again. Any other report for an action a
report settled (confirmed, failed) is 409 invalid_transition, and leaves it as it was.
"""

from __future__ import annotations

import itertools
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
from django.core.cache import cache
from django.utils import timezone
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)
from rest_framework.test import APIClient

from audit.journal import run_stream
from audit.models import JournalEntry
from audit.verification import verify_stream
from runtime.ledger import sources
from runtime.models import TERMINAL, Action, ActionStatus, Checkpoint, Run
from tests.api import (
    fresh_throttle,  # noqa: F401
    new_run,
    session,
)
from tests.conftest import Persona

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

EXAMPLES = 20
STEPS = 25
PROCESSES = ("p1", "p2")
STATS: Counter[str] = Counter()
OPERATIONS = [
    *["lease"] * 2,
    "expire",
    *["takeover"] * 2,
    *["checkpoint"] * 3,
    *["prepare"] * 3,
    *["dispatch"] * 3,
    *["outcome"] * 3,
    *["perform"] * 2,
    *["again"] * 3,
    "heartbeat",
    "release",
    *["revise"] * 2,
    "cancel",
]


def machine_for(agent: Persona, reviewer: Persona) -> type[RuleBasedStateMachine]:
    titles = itertools.count()

    class Protocol(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            STATS["examples"] += 1
            self.clients: dict[str, APIClient] = {p: agent.api() for p in PROCESSES}
            self.clients["alice"] = session(reviewer.user)
            self.runs = [new_run(self.clients["p1"])["run_id"] for _ in range(2)]
            self.fence: dict[tuple[str, str], int] = {}  # (process, run) → fence it holds
            self.seen_rev: dict[tuple[str, str], int] = {}  # (process, run) → rev it saw
            self.taken: dict[str, list[int]] = {run: [] for run in self.runs}
            self.prepared: list[str] = []
            self.run_of: dict[str, str] = {}  # action → its run
            self.released: set[tuple[str, int]] = set()  # (run, fence) an accepted release gave up
            # action → the reports (fence, outcome, result) applied since its latest send, and
            # the last report applied: (process, action, fence, outcome, result).
            self.reports: dict[str, list[tuple[int, str, Any]]] = {}
            self.last_report: tuple[str, str, int, str, Any] | None = None
            for p, index in (("p1", 0), ("p2", 1)):  # each process starts holding one run
                self.lease(p, index)

        # --- helpers ------------------------------------------------------------------------

        def step(self, name: str) -> None:
            STATS["steps"] += 1
            STATS[f"rule {name}"] += 1

        def call(self, who: str, url: str, body: dict[str, Any]) -> Any:
            cache.clear()  # the request rate limit is not under test here
            STATS["calls"] += 1
            return self.clients[who].post(f"/api/v1/{url}", body, format="json")

        def refused(self, response: Any, *codes: str) -> None:
            assert response.status_code == 409, (response.status_code, response.content[:300])
            assert response["Content-Type"] == "application/problem+json"
            assert response.json()["code"] in codes, response.json()
            STATS[f"409 {response.json()['code']}"] += 1

        def accepted(self, response: Any, status: int = 200) -> dict[str, Any]:
            assert response.status_code == status, (response.status_code, response.content[:300])
            STATS[f"{status}"] += 1
            return response.json()

        def row(self, index: int) -> Run:
            return Run.objects.get(pk=self.runs[index])

        # --- leases -------------------------------------------------------------------------

        def lease(self, p: str, index: int) -> None:
            self.step("lease")
            run = self.row(index)
            # Free is what the database says: no expiry, or one in the past.
            live = run.lease_expires_at is not None and run.lease_expires_at > timezone.now()
            response = self.call(
                p, f"runs/{run.pk}/lease/", {"owner": f"{p}-{index}", "ttl_seconds": 60}
            )
            if run.status in TERMINAL:
                self.refused(response, "run_finished", "already_completed")
            elif live:
                self.refused(response, "lease_held")
            else:
                data = self.accepted(response)
                assert data["fence"] == run.fence + 1
                self.fence[(p, str(run.pk))] = data["fence"]
                self.taken[str(run.pk)].append(data["fence"])

        def heartbeat(self, p: str, index: int) -> None:
            self.step("heartbeat")
            run = self.row(index)
            fence = self.fence.get((p, str(run.pk)))
            if fence is None or not run.lease_owner:
                # A heartbeat after the lease was given up is a finding of its own
                # (test_executor_protocol.py::test_a_heartbeat_after_release_...).
                return
            response = self.call(p, f"runs/{run.pk}/lease/heartbeat/", {"fence": fence})
            if fence != run.fence or run.status in TERMINAL:
                self.refused(response, "stale_fence")
            else:
                self.accepted(response)

        def release(self, p: str, index: int) -> None:
            self.step("release")
            run = self.row(index)
            fence = self.fence.get((p, str(run.pk)))
            if fence is None:
                return
            response = self.call(p, f"runs/{run.pk}/lease/release/", {"fence": fence})
            again = (str(run.pk), fence) in self.released and run.fence == fence + 1
            if again and not run.lease_owner:
                # A retry of a release whose answer was lost: what the first one heard. The
                # fence it released is the one before the run's, and nobody leased it since.
                self.accepted(response)
                STATS["200 release repeated"] += 1
            elif fence != run.fence or not run.lease_owner:  # released (or ended): not held
                self.refused(response, "stale_fence")
            else:
                self.accepted(response)
                self.released.add((str(run.pk), fence))

        def expire(self, index: int) -> None:
            """The holder paused past its TTL: move the data, not the database clock."""
            self.step("expire")
            Run.objects.filter(pk=self.runs[index], lease_expires_at__isnull=False).update(
                lease_expires_at=timezone.now() - timedelta(seconds=120)
            )

        # --- checkpoints ----------------------------------------------------------------------

        def checkpoint(self, p: str, index: int, fresh: bool) -> None:
            self.step("checkpoint")
            run = self.row(index)
            fence = self.fence.get((p, str(run.pk)))
            if fence is None:
                return
            expected = run.checkpoint_rev if fresh else self.seen_rev.get((p, str(run.pk)), 0)
            body = {
                "fence": fence,
                "expected_rev": expected,
                "state": {"by": p, "n": next(titles)},
                "next_step": "work",
            }
            response = self.call(p, f"runs/{run.pk}/checkpoints/", body)
            if fence != run.fence:
                self.refused(response, "stale_fence")
            elif run.status in TERMINAL:  # as a prepare, a dispatch and a lease are refused
                self.refused(response, "run_finished")
            elif expected != run.checkpoint_rev:
                self.refused(response, "version_conflict")
            else:
                data = self.accepted(response, 201)
                assert data["rev"] == expected + 1 and data["goal_rev"] == run.goal_rev
            self.seen_rev[(p, str(run.pk))] = Run.objects.get(pk=run.pk).checkpoint_rev

        # --- actions -------------------------------------------------------------------------

        def prepare(self, p: str, index: int) -> None:
            self.step("prepare")
            run = self.row(index)
            fence = self.fence.get((p, str(run.pk)))
            if fence is None:
                return
            body = {
                "fence": fence,
                "tool": "agent.tasks.create",
                "params": {"title": f"task {next(titles)}"},
                "reason": "model step",
            }
            response = self.call(p, f"runs/{run.pk}/actions/", body)
            if fence != run.fence:
                self.refused(response, "stale_fence")
                return
            if run.status in TERMINAL:
                self.refused(response, "run_finished")
                return
            data = self.accepted(response, 201)
            assert data["status"] == "prepared" and data["goal_rev"] == run.goal_rev
            self.prepared.append(str(data["action_id"]))
            self.run_of[str(data["action_id"])] = str(run.pk)

        def dispatch(self, action_id: str, p: str) -> None:
            self.step("dispatch")
            action = Action.objects.get(pk=action_id)
            run = Run.objects.get(pk=action.run_id)
            fence = self.fence.get((p, str(run.pk)))
            if fence is None:
                return
            response = self.call(p, f"actions/{action_id}/dispatch/", {"fence": fence})
            if fence != run.fence:  # a holder that lost the lease learns that first
                self.refused(response, "stale_fence")
            elif action.status == ActionStatus.CANCELLED:
                self.refused(response, "action_cancelled")
            elif run.status in TERMINAL:
                self.refused(response, "run_finished")
            elif action.goal_rev != run.goal_rev:
                self.refused(response, "stale_goal_rev")
            elif action.status in (ActionStatus.SENT, ActionStatus.UNKNOWN):
                # reconcile replay_same_key (the tracker's mode here is `key`): sent again
                assert self.accepted(response)["status"] == "sent"
                self.reports[action_id] = []  # a report before this send is no repeat now
            elif action.status not in (ActionStatus.PREPARED, ActionStatus.APPROVED):
                self.refused(response, "invalid_transition")
            else:
                assert self.accepted(response)["status"] == "sent"
                self.reports[action_id] = []

        def outcome(
            self, action_id: str, p: str, verdict: str, result: Any, fence: int | None = None
        ) -> None:
            """A report; `fence` given: a retry of an earlier one, under the fence it was
            made with (the process may hold another one by now)."""
            self.step("outcome")
            action = Action.objects.get(pk=action_id)
            run = Run.objects.get(pk=action.run_id)
            fence = self.fence.get((p, str(run.pk))) if fence is None else fence
            if fence is None:
                return
            body = {
                "fence": fence,
                "outcome": verdict,
                "external_id": f"EXT-{action_id[:8]}",
                "result": result,
            }
            before, applied = self.stored(action_id), False
            response = self.call(p, f"actions/{action_id}/outcome/", body)
            said = (fence, verdict, result)
            made = self.reports.setdefault(action_id, [])
            if fence != run.fence:
                self.refused(response, "stale_fence")
            elif action.status != ActionStatus.SENT and said in made:
                # The same report again (its answer lost): the action as it is now.
                assert self.accepted(response)["status"] == action.status
                STATS["200 report repeated"] += 1
            elif action.status in (ActionStatus.CONFIRMED, ActionStatus.FAILED):
                # Another report for an action a report settled: the first one stands.
                self.refused(response, "invalid_transition")
                STATS["409 another report of a settled action"] += 1
            elif action.status == ActionStatus.MANUAL_REVIEW:
                self.refused(response, "invalid_transition")  # a person's to resolve
            elif action.goal_rev != run.goal_rev:
                if action.status in (ActionStatus.SENT, ActionStatus.UNKNOWN):
                    self.accepted(response)  # a late result: recorded, the run does not move
                    made.append(said)
                    applied = True
                else:  # settled, or never sent: not a late report's to change
                    self.refused(response, "invalid_transition")
            elif action.status not in sources(verdict):
                self.refused(response, "invalid_transition")
            else:
                data = self.accepted(response)
                made.append(said)
                applied = True
                status = data["status"]
                # The server applies the tool's contract: enough unknowns go to a person.
                assert status == verdict or (verdict, status) == ("unknown", "manual_review")
                if status in ("confirmed", "failed", "unknown"):
                    assert data["result"] == result, (data["result"], result)
            if applied:
                self.last_report = (p, action_id, *said)
                STATS["200 report applied"] += 1
            else:
                assert self.stored(action_id) == before  # a refusal or a repeat writes nothing

        def stored(self, action_id: str) -> tuple[Any, ...]:
            return tuple(
                Action.objects.filter(pk=action_id)
                .values_list("status", "external_id", "result", "reconcile_attempts", "updated_at")
                .get()
            )

        def perform(self, index: int, verdict: str, result: Any) -> None:
            """A step of the executor holding the run (if one does): its newest action sent,
            and what came of it reported — where sends and reports meet most often."""
            run = self.row(index)
            mine = [a for a in self.prepared if self.run_of[a] == str(run.pk)]
            holders = [p for p in PROCESSES if self.fence.get((p, str(run.pk))) == run.fence]
            if not mine or not holders:
                return self.prepare(holders[0] if holders else "p1", index)
            self.dispatch(mine[-1], holders[0])
            if Action.objects.get(pk=mine[-1]).status == ActionStatus.SENT:
                self.outcome(mine[-1], holders[0], verdict, result)

        def again(self, verdict: str, result: Any, exact: bool) -> None:
            """The last report that was applied, sent again under its fence: exactly as it
            was (a retry after a lost answer), or saying `verdict` and `result` (another
            report for the same action, most often a different one)."""
            assert self.last_report is not None
            p, action_id, fence, *said = self.last_report
            if exact:
                verdict, result = said
            self.outcome(action_id, p, verdict, result, fence=fence)

        # --- humans and other clients ------------------------------------------------------

        def revise(self, who: str, index: int, stale: bool) -> None:
            self.step("revise")
            run = self.row(index)
            expected = run.goal_rev - 1 if stale and run.goal_rev > 1 else run.goal_rev
            body = {"goal": {"steps": next(titles)}, "expected_goal_rev": expected}
            response = self.call(who, f"runs/{run.pk}/revisions/", body)
            if run.status in TERMINAL:
                self.refused(response, "run_finished")
            elif expected != run.goal_rev:
                self.refused(response, "version_conflict")
            else:
                assert self.accepted(response)["goal_rev"] == run.goal_rev + 1
                unsent = Action.objects.filter(
                    run=run, status__in=[ActionStatus.PREPARED, ActionStatus.APPROVED]
                )
                assert not unsent.exists()

        def cancel(self, index: int) -> None:
            self.step("cancel")
            run = self.row(index)
            response = self.call("alice", f"runs/{run.pk}/cancel/", {"reason": "model"})
            if run.status in TERMINAL:
                self.refused(response, "run_finished")
            else:
                assert self.accepted(response)["status"] == "cancelled"

        # --- the one rule ---------------------------------------------------------------------
        # One rule choosing among weighted operations, so that swarm testing (which switches
        # whole rules off per example) cannot starve an area of the protocol.

        @rule(
            op=st.sampled_from(OPERATIONS),
            p=st.sampled_from(PROCESSES),
            index=st.sampled_from([0, 1]),
            fresh=st.booleans(),
            verdict=st.sampled_from(["confirmed", "failed", "unknown"]),
            result=st.sampled_from([None, {"n": 1}, {"n": 2}]),
            pick=st.integers(0, 1_000),
            who=st.sampled_from([*PROCESSES, "alice"]),
        )
        def act(
            self,
            op: str,
            p: str,
            index: int,
            fresh: bool,
            verdict: str,
            result: Any,
            pick: int,
            who: str,
        ) -> None:
            if op == "again" and self.last_report is not None:
                return self.again(verdict, result, exact=fresh)
            if op == "perform":
                return self.perform(index, verdict, result)
            if op in ("dispatch", "outcome", "again") and self.prepared:
                action_id = self.prepared[pick % len(self.prepared)]
                if op == "dispatch":
                    return self.dispatch(action_id, p)
                return self.outcome(action_id, p, verdict, result)
            if op == "cancel" and pick % 3 == 0:  # rare: a cancel ends most of a run's story
                return self.cancel(index)
            if op in ("dispatch", "outcome", "again", "perform", "prepare"):
                return self.prepare(p, index)
            if op == "lease":
                return self.lease(p, index)
            if op == "expire":
                return self.expire(index)
            if op == "takeover":  # the holder paused past its TTL and p takes the run over
                self.expire(index)
                return self.lease(p, index)
            if op == "checkpoint":
                return self.checkpoint(p, index, fresh)
            if op == "heartbeat":
                return self.heartbeat(p, index)
            if op == "release":
                return self.release(p, index)
            return self.revise(who, index, stale=not fresh)

        # --- invariants ---------------------------------------------------------------------

        @invariant()
        def fences_strictly_increase(self) -> None:
            for run_id, taken in self.taken.items():
                assert taken == sorted(set(taken)), taken
                fence = 0
                for entry in JournalEntry.objects.filter(
                    stream=run_stream(run_id), type__in=("lease_taken", "lease_released")
                ).order_by("seq"):
                    taken = entry.type == "lease_taken"
                    assert entry.payload["fence"] == fence + taken, (entry.type, entry.payload)
                    fence += 1
                assert Run.objects.get(pk=run_id).fence == fence

        @invariant()
        def no_write_under_a_stale_fence(self) -> None:
            for run_id in self.runs:
                owner = 0
                checkpoints = {c.rev: c for c in Checkpoint.objects.filter(run_id=run_id)}
                actions = {str(a.pk): a for a in Action.objects.filter(run_id=run_id)}
                for entry in JournalEntry.objects.filter(stream=run_stream(run_id)).order_by("seq"):
                    payload = entry.payload
                    if entry.type == "lease_taken":
                        owner = payload["fence"]
                    elif entry.type == "step_committed":
                        assert checkpoints[payload["rev"]].fence == owner, (run_id, payload)
                    elif entry.type == "action_prepared":
                        assert actions[payload["action_id"]].fence == owner
                    elif entry.type == "action_outcome" and payload["action_status"] == "sent":
                        # Each send (a replay with the same key too) under the lease of its
                        # time: the actor names the fence it wrote under.
                        assert int(entry.actor.rsplit("#", 1)[1]) == owner, (run_id, entry.actor)

        @invariant()
        def checkpoint_revs_are_contiguous(self) -> None:
            for run_id in self.runs:
                revs = list(
                    Checkpoint.objects.filter(run_id=run_id)
                    .order_by("rev")
                    .values_list("rev", flat=True)
                )
                assert revs == list(range(1, len(revs) + 1))
                assert Run.objects.get(pk=run_id).checkpoint_rev == len(revs)

        @invariant()
        def nothing_sent_under_an_old_revision(self) -> None:
            for run_id in self.runs:
                entries = JournalEntry.objects.filter(stream=run_stream(run_id))
                bumps = {e.payload["from_rev"]: e.seq for e in entries.filter(type="goal_revised")}
                for entry in entries.filter(type="action_outcome"):
                    if entry.payload["action_status"] != "sent":
                        continue
                    action = Action.objects.get(pk=entry.payload["action_id"])
                    left = bumps.get(action.goal_rev)
                    assert left is None or entry.seq < left, (action.pk, entry.seq, left)

        @invariant()
        def confirmed_has_proof(self) -> None:
            confirmed = Action.objects.filter(run_id__in=self.runs, status="confirmed")
            assert not confirmed.filter(external_id="").exists()

        @invariant()
        def journal_verifies(self) -> None:
            for run_id in self.runs:
                assert verify_stream(run_stream(run_id)) is None

    return Protocol


def test_executor_protocol_model(agent_a: Persona, reviewer_a: Persona) -> None:
    machine = machine_for(agent_a, reviewer_a)
    # Derandomized by the `ci` profile (tests/conftest.py): the same examples on every CI
    # run; a developer's run draws new ones (`--hypothesis-seed=N` replays a draw).
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            database=None,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    print(
        f"\nB6: {STATS['examples']} examples x up to {STEPS} steps: {STATS['steps']} steps, "
        f"{STATS['calls']} calls"
    )
    print("    " + ", ".join(f"{k}: {v}" for k, v in sorted(STATS.items())))
    assert STATS["examples"] >= EXAMPLES
    assert STATS["409 stale_fence"] > 0 and STATS["201"] > 0
