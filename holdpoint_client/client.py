"""`Client`: Holdpoint's agent API (API.md) as typed Python calls.

What it adds over raw HTTP, and why:

- Creating POSTs (runs, checkpoints, actions) carry an `Idempotency-Key`, one uuid4 per
  logical call reused by every retry of that call: a reply lost on the way back can be
  asked for again and the server answers with the first result instead of acting twice.
- Bounded retries with exponential backoff and jitter on 429 (Retry-After honoured), 5xx,
  connection failures and 409 `idempotency_key_in_flight`. Every other 409 is an answer
  about the server's state (a stale fence, a lost compare-and-swap) and is raised at once.
- A call that is not idempotent (dispatching, recording an outcome, revising a goal) is not
  repeated after an ambiguous failure — a lost connection, a gateway's 502/503/504: the
  request may have been applied — and raises
  `TransportError(may_have_applied=True)` so the caller re-reads before acting again.
  Taking a lease is repeated: a repeat cannot take a second one (`calls.lease`).
- List calls return iterators that follow the cursors to the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from types import TracebackType
from typing import Any, TypeVar, Unpack

import httpx
from httpx_sse import EventSource

from holdpoint_client import calls
from holdpoint_client.calls import Call, ClientSettings, Configured, api_root
from holdpoint_client.models import (
    Action,
    Approval,
    Checkpoint,
    JournalEntry,
    LeaseGrant,
    Page,
    Run,
)

T = TypeVar("T")
MAX_WAIT = calls.MAX_WAIT
__all__ = ["Client", "api_root", "MAX_WAIT"]


class Client(Configured):
    """A Holdpoint API client bound to one agent token (and so to one tenant).

    Keyword arguments: `timeout` and the retry policy (`calls.ClientSettings`, shared with
    `AsyncClient`); `transport` is passed to httpx (tests use it to lose a reply on
    purpose), `sleep` is how retries wait.
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
        **settings: Unpack[ClientSettings],
    ) -> None:
        super().__init__(base_url, token, **settings)
        self._sleep = sleep
        self._http = httpx.Client(transport=transport, **self._http_options)

    # --- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- runs ----------------------------------------------------------------------------

    def create_run(
        self,
        graph: str,
        goal: Any,
        *,
        thread_id: str | None = None,
        graph_version: str | None = None,
        idempotency_key: str | None = None,
        external: bool = False,
    ) -> Run:
        """Start a run. Pass a stable `idempotency_key` to make the creation itself
        repeatable across restarts of the caller (24 h on the server). `external=True`: your
        own loop executes it (the executor protocol); Holdpoint's workers never pick it up."""
        return self.send(
            calls.create_run(
                graph,
                goal,
                thread_id=thread_id,
                graph_version=graph_version,
                idempotency_key=idempotency_key,
                external=external,
            )
        )

    def get_run(self, run_id: str, *, wait: float | None = None) -> Run:
        """Read a run. With `wait` (seconds, at most 30) the server answers as soon as the
        run's status, checkpoint_rev or goal_rev changes — a long poll, not a busy loop."""
        return self.send(calls.get_run(run_id, wait))

    def list_runs(
        self,
        *,
        status: str | None = None,
        thread_id: str | None = None,
        graph: str | None = None,
    ) -> Iterator[Run]:
        """Every run matching the filters, newest first, across all pages."""
        return self._iterate(
            lambda cursor: calls.runs_page(
                status=status, thread_id=thread_id, graph=graph, cursor=cursor
            )
        )

    def runs_page(
        self,
        *,
        cursor: str | None = None,
        status: str | None = None,
        thread_id: str | None = None,
        graph: str | None = None,
    ) -> Page[Run]:
        """One page of runs, for callers that keep their own place in the list."""
        return self.send(
            calls.runs_page(status=status, thread_id=thread_id, graph=graph, cursor=cursor)
        )

    def revise(self, run_id: str, goal: Any, *, expected_goal_rev: int) -> Run:
        return self.send(calls.revise(run_id, goal, expected_goal_rev=expected_goal_rev))

    def provide_input(self, run_id: str, data: Any, *, expected_rev: int) -> Run:
        return self.send(calls.provide_input(run_id, data, expected_rev=expected_rev))

    def cancel(self, run_id: str, reason: str = "") -> Run:
        return self.send(calls.cancel(run_id, reason))

    def resume(self, run_id: str, *, expected_rev: int | None = None) -> Run:
        return self.send(calls.resume(run_id, expected_rev=expected_rev))

    def checkpoints(self, run_id: str) -> Iterator[Checkpoint]:
        """The run's checkpoints, newest first."""
        return self._iterate(lambda cursor: calls.checkpoints_page(run_id, cursor=cursor))

    def get_checkpoint(self, run_id: str, rev: int, *, inline: bool = False) -> Checkpoint:
        """One checkpoint; `inline` replaces artifact references in `state` by their content."""
        return self.send(calls.get_checkpoint(run_id, rev, inline=inline))

    def events(
        self, run_id: str, *, after: int = 0, follow: bool = False
    ) -> Iterator[JournalEntry]:
        """The run's journal from `after` (a seq) on. `follow`: live, as the run goes (the
        server-sent event stream, resumed with Last-Event-ID after a lost connection), ending
        after the run's final entry; else what is written so far."""
        if follow:
            yield from self._follow(calls.EventFeed(run_id, after))
            return
        while True:
            entries = self.send(calls.events_after(run_id, after))
            if not entries:
                return
            yield from entries
            after = entries[-1].seq

    def run_actions(self, run_id: str) -> Iterator[Action]:
        return self._iterate(lambda cursor: calls.run_actions_page(run_id, cursor=cursor))

    # --- executor protocol ---------------------------------------------------------------

    def lease(self, run_id: str, owner: str, ttl_seconds: int) -> LeaseGrant:
        """Take the run's lease (fence + 1). Repeated after a failure as reads are (5xx and
        lost answers included): a repeat whose first attempt applied finds that lease — ours,
        its fence unknown — and is refused LeaseHeld; `Executor` waits it out."""
        return self.send(calls.lease(run_id, owner, ttl_seconds))

    def heartbeat(
        self, run_id: str, fence: int, *, ttl_seconds: float | None = None
    ) -> datetime | None:
        """Extend the lease; StaleFence when another executor took the run.

        `ttl_seconds` is sent because the server extends by it (30 s when absent), which is
        not what a lease taken with a shorter ttl expects.
        """
        return self.send(calls.heartbeat(run_id, fence, ttl_seconds))

    def release(self, run_id: str, fence: int) -> None:
        self.send(calls.release(run_id, fence))

    def write_checkpoint(
        self,
        run_id: str,
        *,
        fence: int,
        expected_rev: int,
        state: Mapping[str, Any],
        next_step: str,
        status: str = "running",
        idempotency_key: str | None = None,
        prompt: str = "",
    ) -> Checkpoint:
        return self.send(
            calls.write_checkpoint(
                run_id,
                fence=fence,
                expected_rev=expected_rev,
                state=state,
                next_step=next_step,
                status=status,
                idempotency_key=idempotency_key,
                prompt=prompt,
            )
        )

    def prepare_action(
        self,
        run_id: str,
        *,
        fence: int,
        tool: str,
        params: Mapping[str, Any],
        reason: str = "",
        target: str = "",
        idempotency_key: str | None = None,
        expected_goal_rev: int | None = None,
    ) -> Action:
        """Record an intended side effect. `idempotency_key` is the *ledger* key: the same
        key with the same params returns the action prepared before (200, not 201).
        `expected_goal_rev`: the goal revision you last read (VersionConflict if the goal
        was revised since — nothing is prepared)."""
        return self.send(
            calls.prepare_action(
                run_id,
                fence=fence,
                tool=tool,
                params=params,
                reason=reason,
                target=target,
                idempotency_key=idempotency_key,
                expected_goal_rev=expected_goal_rev,
            )
        )

    def get_action(self, action_id: str) -> Action:
        return self.send(calls.get_action(action_id))

    def dispatch(self, action_id: str, fence: int) -> Action:
        """Mark the action `sent` — durably, before the caller sends anything."""
        return self.send(calls.dispatch(action_id, fence))

    def record_outcome(
        self,
        action_id: str,
        *,
        fence: int,
        outcome: str,
        external_id: str = "",
        result: Any = None,
    ) -> Action:
        """`confirmed` (with the external id that proves it), `failed` or `unknown`."""
        return self.send(
            calls.record_outcome(
                action_id, fence=fence, outcome=outcome, external_id=external_id, result=result
            )
        )

    def find_actions(
        self,
        *,
        idempotency_key: str | None = None,
        status: str | None = None,
        tool: str | None = None,
    ) -> list[Action]:
        """Actions of this tenant matching the filters (all pages)."""
        return list(
            self._iterate(
                lambda cursor: calls.actions_page(
                    idempotency_key=idempotency_key, status=status, tool=tool, cursor=cursor
                )
            )
        )

    # --- approvals and manual reconciliation ---------------------------------------------

    def approvals(self, *, status: str | None = None) -> Iterator[Approval]:
        return self._iterate(lambda cursor: calls.approvals_page(status=status, cursor=cursor))

    def get_approval(self, approval_id: str, *, wait: float | None = None) -> Approval:
        """Read an approval; with `wait` the server answers as soon as it changes."""
        return self.send(calls.get_approval(approval_id, wait))

    def decide(
        self,
        approval_id: str,
        decision: str,
        *,
        action_hash: str,
        reason: str = "",
        edits: Mapping[str, Any] | None = None,
    ) -> Approval:
        """Approve or reject the exact action hash the decider saw. Safe to repeat: the
        same decision again returns the same approval."""
        return self.send(
            calls.decide(approval_id, decision, action_hash=action_hash, reason=reason, edits=edits)
        )

    def resolve(
        self, action_id: str, outcome: str, *, external_id: str = "", note: str = ""
    ) -> Action:
        """A human's verdict on an action nobody could settle: `applied` or `not_applied`."""
        return self.send(calls.resolve(action_id, outcome, external_id=external_id, note=note))

    # --- transport -----------------------------------------------------------------------

    def send(self, call: Call[T]) -> T:
        """One logical call: the same request (same Idempotency-Key) until an answer."""
        attempt = 0
        while True:
            try:
                response = self._http.request(**call.request(self.timeout))
            except calls.NO_ANSWER as exc:
                delay = self.policy.pause(call, attempt, error=exc)
            else:
                if response.is_success:
                    return call.answer(response)
                delay = self.policy.pause(call, attempt, response=response)
            self._sleep(delay)
            attempt += 1

    def _follow(self, feed: calls.EventFeed) -> Iterator[JournalEntry]:
        attempt = 0
        while True:
            try:
                with self._http.stream(**feed.request(self.timeout)) as response:
                    if not response.is_success:
                        response.read()
                        self._sleep(self.policy.pause(feed.call(), attempt, response=response))
                        attempt += 1
                        continue
                    for sse in EventSource(response).iter_sse():
                        entry = feed.take(sse.data)
                        if entry is not None:
                            attempt = 0
                            yield entry
                if feed.ended(self.get_run(feed.run_id).status):
                    return
                self._sleep(feed.pause(self.policy))
            except calls.NO_ANSWER as exc:
                self._sleep(self.policy.pause(feed.call(), attempt, error=exc))
                attempt += 1

    def _iterate(self, page: Callable[[str | None], Call[Page[T]]]) -> Iterator[T]:
        """Follow the cursors: each page is fetched only when the previous one is used up."""
        cursor: str | None = None
        while True:
            found = self.send(page(cursor))
            yield from found.results
            if not found.next_cursor:
                return
            cursor = found.next_cursor
