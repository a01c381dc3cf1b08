"""`Client`: Holdpoint's agent API (API.md) as typed Python calls.

What it adds over raw HTTP, and why:

- Creating POSTs (runs, checkpoints, actions) carry an `Idempotency-Key`, one uuid4 per
  logical call reused by every retry of that call: a reply lost on the way back can be
  asked for again and the server answers with the first result instead of acting twice.
- Bounded retries with exponential backoff and jitter on 429 (Retry-After honoured), 5xx,
  connection failures and 409 `idempotency_key_in_flight`. Every other 409 is an answer
  about the server's state (a stale fence, a lost compare-and-swap) and is raised at once.
- A call that is not idempotent (taking a lease, dispatching, recording an outcome) is not
  repeated after an ambiguous failure — the request may have been applied — and raises
  `TransportError(may_have_applied=True)` so the caller re-reads before acting again.
- List calls return iterators that follow the cursors to the end.
"""

from __future__ import annotations

import json
import logging
import random
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from email.utils import parsedate_to_datetime
from types import TracebackType
from typing import Any, TypeVar

import httpx

from holdpoint_client.errors import (
    HoldpointAPIError,
    IdempotencyKeyInFlight,
    ServerError,
    ServiceUnavailable,
    Throttled,
    TransportError,
    error_from_response,
)
from holdpoint_client.models import (
    Action,
    Approval,
    Checkpoint,
    JournalEntry,
    LeaseGrant,
    Page,
    Run,
    parse_time,
)

log = logging.getLogger("holdpoint_client")
T = TypeVar("T")
API_PREFIX = "/api/v1/"
MAX_WAIT = 30.0  # the server's ceiling for ?wait=
# Failures where the request certainly never reached the server: always safe to repeat.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def api_root(base_url: str) -> str:
    """Accept the server root or the API root: both name the same API."""
    root = base_url.rstrip("/")
    if root.endswith(API_PREFIX.rstrip("/")):
        return root + "/"
    return root + API_PREFIX


def _dumps(body: Any) -> bytes:
    """Strict JSON: the server refuses NaN and Infinity, so fail here, before sending."""
    return json.dumps(body, allow_nan=False, ensure_ascii=False, separators=(",", ":")).encode()


def _retry_after(response: httpx.Response) -> float | None:
    raw = response.headers.get("Retry-After")
    if not raw:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class Client:
    """A Holdpoint API client bound to one agent token (and so to one tenant).

    `retries` is how many times one logical call may be repeated after a retryable failure;
    `backoff` the first pause in seconds, doubling up to `max_backoff`, each drawn with
    jitter so that many agents hit by the same outage do not come back in lockstep. A 429
    whose Retry-After exceeds `max_retry_after` is raised rather than slept through.
    `transport` is passed to httpx (tests use it to lose a reply on purpose).
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout: float = 10.0,
        retries: int = 4,
        backoff: float = 0.5,
        max_backoff: float = 20.0,
        max_retry_after: float = 60.0,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.base_url = api_root(base_url)
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.max_retry_after = max_retry_after
        self._sleep = sleep
        self._http = httpx.Client(
            base_url=self.base_url,
            headers={
                "Authorization": f"Token {token}",
                "Accept": "application/json, application/problem+json",
                "User-Agent": "holdpoint-client/0.1",
            },
            timeout=timeout,
            transport=transport,
        )

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
        body: dict[str, Any] = {"graph": graph, "goal": goal}
        if external:
            body["external"] = True
        if thread_id is not None:
            body["thread_id"] = thread_id
        if graph_version is not None:
            body["graph_version"] = graph_version
        data = self._post("runs/", body, create=True, idempotency_key=idempotency_key)
        return Run.from_json(data)

    def get_run(self, run_id: str, *, wait: float | None = None) -> Run:
        """Read a run. With `wait` (seconds, at most 30) the server answers as soon as the
        run's status, checkpoint_rev or goal_rev changes — a long poll, not a busy loop."""
        params, extra = self._wait_params(wait)
        return Run.from_json(self._get(f"runs/{run_id}/", params, extra_timeout=extra))

    def list_runs(
        self,
        *,
        status: str | None = None,
        thread_id: str | None = None,
        graph: str | None = None,
    ) -> Iterator[Run]:
        """Every run matching the filters, newest first, across all pages."""
        params = _filters(status=status, thread_id=thread_id, graph=graph)
        return self._iterate("runs/", params, Run.from_json)

    def runs_page(
        self,
        *,
        cursor: str | None = None,
        status: str | None = None,
        thread_id: str | None = None,
        graph: str | None = None,
    ) -> Page[Run]:
        """One page of runs, for callers that keep their own place in the list."""
        params = _filters(status=status, thread_id=thread_id, graph=graph, cursor=cursor)
        return Page.from_json(self._get("runs/", params), Run.from_json)

    def revise(self, run_id: str, goal: Any, *, expected_goal_rev: int) -> Run:
        body = {"goal": goal, "expected_goal_rev": expected_goal_rev}
        return Run.from_json(self._post(f"runs/{run_id}/revisions/", body))

    def provide_input(self, run_id: str, data: Any, *, expected_rev: int) -> Run:
        body = {"data": data, "expected_rev": expected_rev}
        return Run.from_json(self._post(f"runs/{run_id}/input/", body))

    def cancel(self, run_id: str, reason: str = "") -> Run:
        return Run.from_json(self._post(f"runs/{run_id}/cancel/", {"reason": reason}))

    def resume(self, run_id: str, *, expected_rev: int | None = None) -> Run:
        body = {} if expected_rev is None else {"expected_rev": expected_rev}
        return Run.from_json(self._post(f"runs/{run_id}/resume/", body))

    def checkpoints(self, run_id: str) -> Iterator[Checkpoint]:
        """The run's checkpoints, newest first."""
        return self._iterate(f"runs/{run_id}/checkpoints/", {}, Checkpoint.from_json)

    def get_checkpoint(self, run_id: str, rev: int, *, inline: bool = False) -> Checkpoint:
        """One checkpoint; `inline` replaces artifact references in `state` by their content."""
        params = {"inline": "1"} if inline else {}
        return Checkpoint.from_json(self._get(f"runs/{run_id}/checkpoints/{rev}/", params))

    def events(self, run_id: str, *, after: int = 0) -> Iterator[JournalEntry]:
        """The run's journal from `after` (a seq) on, following the stream to its end."""
        while True:
            data = self._get(f"runs/{run_id}/events/", {"after": str(after)})
            entries = [JournalEntry.from_json(item) for item in data.get("results") or []]
            if not entries:
                return
            yield from entries
            after = entries[-1].seq

    def run_actions(self, run_id: str) -> Iterator[Action]:
        return self._iterate(f"runs/{run_id}/actions/", {}, Action.from_json)

    # --- executor protocol ---------------------------------------------------------------

    def lease(self, run_id: str, owner: str, ttl_seconds: int) -> LeaseGrant:
        """Take the run's lease (fence + 1). Not repeated after an ambiguous failure: a
        second attempt would find our own first lease and answer lease_held."""
        body = {"owner": owner, "ttl_seconds": ttl_seconds}
        return LeaseGrant.from_json(self._post(f"runs/{run_id}/lease/", body))

    def heartbeat(
        self, run_id: str, fence: int, *, ttl_seconds: float | None = None
    ) -> datetime | None:
        """Extend the lease; StaleFence when another executor took the run.

        `ttl_seconds` is sent because the server extends by it (30 s when absent), which is
        not what a lease taken with a shorter ttl expects.
        """
        body: dict[str, Any] = {"fence": fence}
        if ttl_seconds is not None:
            body["ttl_seconds"] = ttl_seconds
        data = self._post(f"runs/{run_id}/lease/heartbeat/", body, replay_safe=True)
        return parse_time(data.get("expires_at"))

    def release(self, run_id: str, fence: int) -> None:
        self._post(f"runs/{run_id}/lease/release/", {"fence": fence}, replay_safe=True)

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
    ) -> Checkpoint:
        body = {
            "fence": fence,
            "expected_rev": expected_rev,
            "state": dict(state),
            "next_step": next_step,
            "status": status,
        }
        data = self._post(
            f"runs/{run_id}/checkpoints/", body, create=True, idempotency_key=idempotency_key
        )
        return Checkpoint.from_json(data)

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
    ) -> Action:
        """Record an intended side effect. `idempotency_key` is the *ledger* key: the same
        key with the same params returns the action prepared before (200, not 201)."""
        body: dict[str, Any] = {
            "fence": fence,
            "tool": tool,
            "params": dict(params),
            "reason": reason,
            "target": target,
        }
        if idempotency_key is not None:
            body["idempotency_key"] = idempotency_key
        return Action.from_json(self._post(f"runs/{run_id}/actions/", body, create=True))

    def get_action(self, action_id: str) -> Action:
        return Action.from_json(self._get(f"actions/{action_id}/"))

    def dispatch(self, action_id: str, fence: int) -> Action:
        """Mark the action `sent` — durably, before the caller sends anything."""
        return Action.from_json(self._post(f"actions/{action_id}/dispatch/", {"fence": fence}))

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
        body = {"fence": fence, "outcome": outcome, "external_id": external_id, "result": result}
        return Action.from_json(self._post(f"actions/{action_id}/outcome/", body))

    def find_actions(
        self,
        *,
        idempotency_key: str | None = None,
        status: str | None = None,
        tool: str | None = None,
    ) -> list[Action]:
        """Actions of this tenant matching the filters (all pages)."""
        params = _filters(idempotency_key=idempotency_key, status=status, tool=tool)
        return list(self._iterate("actions/", params, Action.from_json))

    # --- approvals and manual reconciliation ---------------------------------------------

    def approvals(self, *, status: str | None = None) -> Iterator[Approval]:
        return self._iterate("approvals/", _filters(status=status), Approval.from_json)

    def get_approval(self, approval_id: str, *, wait: float | None = None) -> Approval:
        """Read an approval; with `wait` the server answers as soon as it changes."""
        params, extra = self._wait_params(wait)
        data = self._get(f"approvals/{approval_id}/", params, extra_timeout=extra)
        return Approval.from_json(data)

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
        body: dict[str, Any] = {"decision": decision, "action_hash": action_hash, "reason": reason}
        if edits is not None:
            body["edits"] = dict(edits)
        data = self._post(f"approvals/{approval_id}/decision/", body, replay_safe=True)
        return Approval.from_json(data)

    def resolve(
        self, action_id: str, outcome: str, *, external_id: str = "", note: str = ""
    ) -> Action:
        """A human's verdict on an action nobody could settle: `applied` or `not_applied`."""
        body = {"outcome": outcome, "external_id": external_id, "note": note}
        return Action.from_json(self._post(f"actions/{action_id}/resolve/", body))

    # --- transport -----------------------------------------------------------------------

    def _get(
        self, path: str, params: Mapping[str, str] | None = None, *, extra_timeout: float = 0.0
    ) -> Any:
        return self._request("GET", path, params=params, replay_safe=True, extra=extra_timeout)

    def _post(
        self,
        path: str,
        body: Any,
        *,
        create: bool = False,
        idempotency_key: str | None = None,
        replay_safe: bool = False,
    ) -> Any:
        headers: dict[str, str] = {}
        if create:
            headers["Idempotency-Key"] = idempotency_key or uuid.uuid4().hex
        return self._request(
            "POST", path, body=body, headers=headers, replay_safe=replay_safe or create
        )

    def _request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
        replay_safe: bool,
        extra: float = 0.0,
    ) -> Any:
        """One logical call: the same request (same Idempotency-Key) until an answer."""
        content = None if body is None else _dumps(body)
        all_headers = dict(headers or {})
        if content is not None:
            all_headers["Content-Type"] = "application/json"
        timeout = httpx.Timeout(self.timeout + extra)
        attempt = 0
        while True:
            try:
                response = self._http.request(
                    method,
                    path,
                    params=params,
                    content=content,
                    headers=all_headers,
                    timeout=timeout,
                )
            except httpx.TransportError as exc:
                sent = not isinstance(exc, _NOT_SENT)
                if attempt < self.retries and (replay_safe or not sent):
                    self._pause(attempt, None, f"{method} {path}: {type(exc).__name__}")
                    attempt += 1
                    continue
                raise TransportError(
                    f"{method} {path}: {type(exc).__name__}: {exc}",
                    may_have_applied=sent and method != "GET",
                ) from exc
            if response.is_success:
                return response.json() if response.content else {}
            error = error_from_response(response)
            if attempt < self.retries and _retryable(error, replay_safe):
                wait = _retry_after(response)
                if wait is not None and wait > self.max_retry_after:
                    raise error
                self._pause(attempt, wait, f"{method} {path}: {error.status} {error.code}")
                attempt += 1
                continue
            raise error

    def _pause(self, attempt: int, retry_after: float | None, why: str) -> None:
        """Exponential backoff with jitter, or exactly what the server asked for."""
        if retry_after is not None:
            delay = retry_after
        else:
            ceiling = min(self.max_backoff, self.backoff * (2**attempt))
            delay = random.uniform(ceiling / 2, ceiling)
        log.info("retrying in %.2fs after %s (attempt %d)", delay, why, attempt + 1)
        self._sleep(delay)

    def _wait_params(self, wait: float | None) -> tuple[dict[str, str], float]:
        if not wait:
            return {}, 0.0
        seconds = min(max(0.0, wait), MAX_WAIT)
        return {"wait": f"{seconds:g}"}, seconds

    def _iterate(
        self,
        path: str,
        params: Mapping[str, str],
        parse: Callable[[Mapping[str, Any]], T],
    ) -> Iterator[T]:
        """Follow the cursors: each page is fetched only when the previous one is used up."""
        cursor: str | None = None
        while True:
            query = dict(params)
            if cursor:
                query["cursor"] = cursor
            page = Page.from_json(self._get(path, query), parse)
            yield from page.results
            if not page.next_cursor:
                return
            cursor = page.next_cursor


def _retryable(error: HoldpointAPIError, replay_safe: bool) -> bool:
    """429 and a key still in flight always; 503 always (refused before any work); other
    5xx only when repeating the call cannot apply it twice."""
    if isinstance(error, Throttled | IdempotencyKeyInFlight | ServiceUnavailable):
        return True
    return isinstance(error, ServerError) and replay_safe


def _filters(**values: str | None) -> dict[str, str]:
    return {name: value for name, value in values.items() if value is not None}
