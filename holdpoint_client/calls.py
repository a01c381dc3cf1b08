"""Holdpoint's API calls as data: what to send and how to read the answer, without I/O.

`Client` (httpx.Client) and `AsyncClient` (httpx.AsyncClient) send the same `Call`s: each
endpoint's path, body, idempotency and replay safety is written here once, and the two
clients differ only in how they wait for the socket. The same goes for the retry policy
(`RetryPolicy`): which failures are repeated, after how long, and when `Retry-After` wins.
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Any, Generic, TypedDict, TypeVar, Unpack
from urllib.parse import quote

import httpx

from holdpoint_client.errors import (
    HoldpointAPIError,
    IdempotencyKeyInFlight,
    ServerError,
    Throttled,
    ToolUnavailable,
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
SERVER_LEASE_TTL = 30.0  # what a heartbeat without ttl_seconds extends the lease by
USER_AGENT = "holdpoint-client/0.2"
# What the models' `from_json` raise on JSON of another shape (a missing field, a list for
# an object, a number that is not one): an answer that does not fit, not a bug to crash on.
UNFIT = (KeyError, TypeError, ValueError, AttributeError)
# Failures where the request certainly never reached the server: always safe to repeat.
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# What httpx raises when no usable answer arrived: the transport failed, or an answer came
# whose body its Content-Encoding does not decode (a DecodingError is not a TransportError).
NO_ANSWER = (httpx.TransportError, httpx.DecodingError)
Failure = httpx.TransportError | httpx.DecodingError


def api_root(base_url: str) -> str:
    """Accept the server root or the API root: both name the same API."""
    root = base_url.rstrip("/")
    if root.endswith(API_PREFIX.rstrip("/")):
        return root + "/"
    return root + API_PREFIX


def default_headers(token: str) -> dict[str, str]:
    return {
        "Authorization": f"Token {token}",
        "Accept": "application/json, application/problem+json",
        "User-Agent": USER_AGENT,
    }


def trace_headers() -> dict[str, str]:
    """The W3C `traceparent` (and `tracestate`) of the caller's current OpenTelemetry span,
    when its process uses OpenTelemetry: the server's span for the call — and every span of a
    run it creates, whichever worker runs it — then belongs to the agent's own trace. Nothing
    without opentelemetry-api installed or without a current span (the client does not
    depend on it)."""
    global _inject
    if _inject is None:
        try:
            from opentelemetry.propagate import inject
        except ImportError:
            _inject = False
            return {}
        _inject = inject
    if _inject is False:
        return {}
    carrier: dict[str, str] = {}
    _inject(carrier)
    return {k: v for k, v in carrier.items() if k in ("traceparent", "tracestate")}


_inject: Any = None  # opentelemetry.propagate.inject once looked up; False: not installed


def dumps(body: Any) -> bytes:
    """Strict JSON: the server refuses NaN and Infinity, so fail here, before sending."""
    return json.dumps(body, allow_nan=False, ensure_ascii=False, separators=(",", ":")).encode()


def _identity(data: Any) -> Any:
    return data


def at(collection: str, object_id: Any, *rest: str | int) -> str:
    """The path `collection/<id>/<rest>/…/`, each part one quoted segment: an id holding
    "/", "?", "#" or ".." names nothing but itself (the API answers 404) — never another
    endpoint, as `actions/../runs/<id>/cancel/#/dispatch/` would be."""
    return "".join(f"{_segment(part)}/" for part in (collection, object_id, *rest))


def _segment(value: Any) -> str:
    text = str(value)
    if text in ("", ".", ".."):
        raise ValueError(f"not an id: {text!r}")
    return quote(text, safe="")


@dataclass(frozen=True)
class Call(Generic[T]):
    """One logical API call. `replay_safe`: repeating it after an ambiguous failure cannot
    apply it twice (reads, creating POSTs under one Idempotency-Key, decisions).

    `timeout` and `retries` cap the client's own (never raise them) for a call that is
    worthless after a while — a heartbeat is, once the lease it renews has run out — and
    `timeout` also caps each pause between its attempts (a longer Retry-After is raised)."""

    method: str
    path: str
    parse: Callable[[Any], T]
    params: Mapping[str, str] = field(default_factory=dict)
    body: Any = None
    headers: Mapping[str, str] = field(default_factory=dict)
    replay_safe: bool = False
    extra_timeout: float = 0.0
    timeout: float | None = None
    retries: int | None = None

    def request(self, timeout: float) -> dict[str, Any]:
        """httpx's `request` arguments; every attempt of the call sends the same bytes."""
        if self.timeout is not None:
            timeout = min(timeout, self.timeout)
        headers = {**trace_headers(), **self.headers}
        if self.body is not None:
            headers["Content-Type"] = "application/json"
        return {
            "method": self.method,
            "url": self.path,
            "params": self.params,
            "content": None if self.body is None else dumps(self.body),
            "headers": headers,
            "timeout": httpx.Timeout(timeout + self.extra_timeout),
        }

    def answer(self, response: httpx.Response) -> T:
        kind = response.headers.get("content-type", "no content type")
        try:
            data = response.json() if response.content else {}
        except ValueError:
            raise self.unreadable(
                f"HTTP {response.status_code} answered with {kind}, not JSON"
            ) from None
        try:
            return self.parse(data)
        except UNFIT as exc:
            raise self.unreadable(
                f"HTTP {response.status_code} answered {kind} that is not the API's "
                f"({type(exc).__name__}: {exc})"
            ) from exc

    def unreadable(self, answered: str) -> TransportError:
        """A success this client cannot read: not Holdpoint's answer (a login portal, a
        proxy's page, a base URL that is not the API's) or not one of this API version.
        Whether the request reached Holdpoint cannot be told from it."""
        return TransportError(
            f"{self.method} {self.path}: {answered} — is the base URL Holdpoint's API "
            "(…/api/v1/), with no proxy or login page in the way?",
            may_have_applied=self.method != "GET",
        )


def get(
    path: str, parse: Callable[[Any], T], params: Mapping[str, str] | None = None, wait: float = 0
) -> Call[T]:
    return Call("GET", path, parse, dict(params or {}), replay_safe=True, extra_timeout=wait)


def post(
    path: str,
    body: Any,
    parse: Callable[[Any], T],
    *,
    create: bool = False,
    idempotency_key: str | None = None,
    replay_safe: bool = False,
) -> Call[T]:
    """A POST; `create` gives it an Idempotency-Key (one per logical call, reused by every
    retry of it), which also makes it safe to repeat."""
    headers = {"Idempotency-Key": idempotency_key or uuid.uuid4().hex} if create else {}
    return Call("POST", path, parse, body=body, headers=headers, replay_safe=replay_safe or create)


def wait_params(wait: float | None) -> tuple[dict[str, str], float]:
    if not wait:
        return {}, 0.0
    seconds = min(max(0.0, wait), MAX_WAIT)
    return {"wait": f"{seconds:g}"}, seconds


def filters(**values: str | None) -> dict[str, str]:
    return {name: value for name, value in values.items() if value is not None}


def page_of(parse: Callable[[Mapping[str, Any]], T]) -> Callable[[Any], Page[T]]:
    return lambda data: Page.from_json(data, parse)


# --- the endpoints (API.md) --------------------------------------------------------------


def create_run(
    graph: str,
    goal: Any,
    *,
    thread_id: str | None = None,
    graph_version: str | None = None,
    idempotency_key: str | None = None,
    external: bool = False,
) -> Call[Run]:
    body: dict[str, Any] = {"graph": graph, "goal": goal}
    if external:
        body["external"] = True
    if thread_id is not None:
        body["thread_id"] = thread_id
    if graph_version is not None:
        body["graph_version"] = graph_version
    return post("runs/", body, Run.from_json, create=True, idempotency_key=idempotency_key)


def get_run(run_id: str, wait: float | None = None) -> Call[Run]:
    params, extra = wait_params(wait)
    return get(at("runs", run_id), Run.from_json, params, extra)


def runs_page(**query: str | None) -> Call[Page[Run]]:
    return get("runs/", page_of(Run.from_json), filters(**query))


def revise(run_id: str, goal: Any, *, expected_goal_rev: int) -> Call[Run]:
    body = {"goal": goal, "expected_goal_rev": expected_goal_rev}
    return post(at("runs", run_id, "revisions"), body, Run.from_json)


def provide_input(run_id: str, data: Any, *, expected_rev: int) -> Call[Run]:
    body = {"data": data, "expected_rev": expected_rev}
    return post(at("runs", run_id, "input"), body, Run.from_json)


def cancel(run_id: str, reason: str = "") -> Call[Run]:
    return post(at("runs", run_id, "cancel"), {"reason": reason}, Run.from_json)


def resume(run_id: str, *, expected_rev: int | None = None) -> Call[Run]:
    body = {} if expected_rev is None else {"expected_rev": expected_rev}
    return post(at("runs", run_id, "resume"), body, Run.from_json)


def checkpoints_page(run_id: str, **query: str | None) -> Call[Page[Checkpoint]]:
    return get(at("runs", run_id, "checkpoints"), page_of(Checkpoint.from_json), filters(**query))


def events_after(run_id: str, after: int) -> Call[list[JournalEntry]]:
    return get(
        at("runs", run_id, "events"),
        lambda data: [JournalEntry.from_json(item) for item in data.get("results") or []],
        {"after": str(after)},
    )


# The run statuses after which a run's journal ends (the server closes its stream there).
FINAL_STATUSES = frozenset({"completed", "failed", "cancelled"})
STREAM_READ_TIMEOUT = 45.0  # the server sends a comment line at least every 15 s
# The longest pause before reopening a stream that closed with nothing new (see EventFeed).
STREAM_IDLE_PAUSE = 5.0


@dataclass
class EventFeed:
    """A run's live journal (`GET runs/{id}/events/?stream=1`) across reconnects, without
    I/O: where to resume (`last`, sent as Last-Event-ID), which events are new, and whether
    a closed stream is the end. `Client.events` and `AsyncClient.events` drive it."""

    run_id: str
    last: int = 0
    received: int = 0  # events taken on the current connection
    idle: int = 0  # clean closes in a row that brought nothing new
    finished_seen: bool = False  # the run was read finished after a connection closed
    after_finish: bool = False  # the current connection was opened after that read

    def call(self) -> Call[None]:
        """The request (a Call, so the retry policy treats it as a safe read)."""
        headers = {"Accept": "text/event-stream", "Last-Event-ID": str(self.last)}
        return Call(
            "GET",
            at("runs", self.run_id, "events"),
            lambda _: None,
            {"stream": "1", "after": str(self.last)},
            headers=headers,
            replay_safe=True,
        )

    def request(self, timeout: float) -> dict[str, Any]:
        args = self.call().request(timeout)
        args["timeout"] = httpx.Timeout(timeout, read=STREAM_READ_TIMEOUT)
        self.received = 0
        self.after_finish = self.finished_seen
        return args

    def take(self, data: str) -> JournalEntry | None:
        """The entry an event carries, or None for one already seen (ids only grow) or for
        a comment line (the server's keep-alive)."""
        if not data:
            return None
        try:
            entry = JournalEntry.from_json(json.loads(data))
        except UNFIT as exc:
            raise self.call().unreadable(
                f"the event stream sent a line that is not a journal entry "
                f"({type(exc).__name__}: {exc}): {data[:200]!r}"
            ) from exc
        if entry.seq <= self.last:
            return None
        self.last, self.received = entry.seq, self.received + 1
        return entry

    def ended(self, status: str) -> bool:
        """After the server closed the stream cleanly, the run now being in `status`: is that
        the end of its journal? The server closes after the run's final entry, and at once
        (nothing new) for a run already finished. Which entry is final only the run's status
        tells, so a close is resumed from `last` unless the run is finished and the last
        connection brought nothing new — any other close (a server restarting) is resumed.

        That connection must have been opened *after* the run was read finished: one that
        was already open (or closed) when the run finished may have missed the final entry,
        which is committed with the status — so the first finished read buys one more
        connection, and only its emptiness ends the feed."""
        if status not in FINAL_STATUSES:
            return False
        if self.after_finish and self.received == 0:
            return True
        self.finished_seen = True
        return False

    def pause(self, policy: RetryPolicy) -> float:
        """How long to wait before reopening a stream that closed cleanly and is not ended.

        A server that does not follow live (a WSGI server, a buffering proxy) answers what
        is there and closes at once: reopened straight away, that is two requests in a
        tight loop for as long as the run lives. A close that brought entries is reopened
        at once; one that brought nothing waits the policy's backoff, doubling, up to
        STREAM_IDLE_PAUSE — a long poll's pace, not a busy loop."""
        if self.received or self.finished_seen:  # more to read, or the last look
            self.idle = 0
            return 0.0
        self.idle += 1
        return min(STREAM_IDLE_PAUSE, policy.backoff * 2.0 ** min(self.idle - 1, 16))


def run_actions_page(run_id: str, **query: str | None) -> Call[Page[Action]]:
    return get(at("runs", run_id, "actions"), page_of(Action.from_json), filters(**query))


def approvals_page(**query: str | None) -> Call[Page[Approval]]:
    return get("approvals/", page_of(Approval.from_json), filters(**query))


def get_checkpoint(run_id: str, rev: int, *, inline: bool = False) -> Call[Checkpoint]:
    params = {"inline": "1"} if inline else {}
    return get(at("runs", run_id, "checkpoints", rev), Checkpoint.from_json, params)


def lease(run_id: str, owner: str, ttl_seconds: int) -> Call[LeaseGrant]:
    """Take the lease. Safe to repeat, so repeated as reads are (Holdpoint's own 500 and 503
    too, with backoff or after Retry-After): a second attempt cannot take a second lease —
    if the first one applied, its lease is live and the repeat is refused `lease_held`, which
    the executor waits out (the lease is ours, its fence unknown) as it waits out anyone's."""
    body = {"owner": owner, "ttl_seconds": ttl_seconds}
    return post(at("runs", run_id, "lease"), body, LeaseGrant.from_json, replay_safe=True)


def heartbeat(run_id: str, fence: int, ttl_seconds: float | None = None) -> Call[datetime | None]:
    """Renew the lease. Its attempts are bounded by the lease, not by the client's policy
    (4 retries of 10 s): a beat still retrying when the lease runs out keeps the executor
    from beating again — and so from hearing `stale_fence` — long after a successor took
    the run. Each attempt gets a quarter of the ttl, one retry at most: a beat is over
    within 3/4 of the ttl, and the next (ttl/3 later) tries again."""
    body: dict[str, Any] = {"fence": fence}
    if ttl_seconds is not None:
        body["ttl_seconds"] = ttl_seconds
    call = post(
        at("runs", run_id, "lease", "heartbeat"),
        body,
        lambda data: parse_time(data.get("expires_at")),
        replay_safe=True,
    )
    lease = SERVER_LEASE_TTL if ttl_seconds is None else ttl_seconds
    return replace(call, timeout=lease / 4, retries=1)


def release(run_id: str, fence: int) -> Call[Any]:
    return post(
        at("runs", run_id, "lease", "release"), {"fence": fence}, _identity, replay_safe=True
    )


def write_checkpoint(
    run_id: str,
    *,
    fence: int,
    expected_rev: int,
    state: Mapping[str, Any],
    next_step: str,
    status: str = "running",
    idempotency_key: str | None = None,
    prompt: str = "",
) -> Call[Checkpoint]:
    """`prompt`: with status `waiting_input`, what the agent asks for (the run's
    `waiting_for`, shown to whoever gives the input)."""
    body: dict[str, Any] = {
        "fence": fence,
        "expected_rev": expected_rev,
        "state": dict(state),
        "next_step": next_step,
        "status": status,
    }
    if prompt:
        body["prompt"] = prompt
    return post(
        at("runs", run_id, "checkpoints"),
        body,
        Checkpoint.from_json,
        create=True,
        idempotency_key=idempotency_key,
    )


def prepare_action(
    run_id: str,
    *,
    fence: int,
    tool: str,
    params: Mapping[str, Any],
    reason: str = "",
    target: str = "",
    idempotency_key: str | None = None,
    expected_goal_rev: int | None = None,
) -> Call[Action]:
    body: dict[str, Any] = {
        "fence": fence,
        "tool": tool,
        "params": dict(params),
        "reason": reason,
        "target": target,
    }
    if idempotency_key is not None:
        body["idempotency_key"] = idempotency_key
    if expected_goal_rev is not None:
        body["expected_goal_rev"] = expected_goal_rev
    return post(at("runs", run_id, "actions"), body, Action.from_json, create=True)


def get_action(action_id: str) -> Call[Action]:
    return get(at("actions", action_id), Action.from_json)


def dispatch(action_id: str, fence: int) -> Call[Action]:
    return post(at("actions", action_id, "dispatch"), {"fence": fence}, Action.from_json)


def record_outcome(
    action_id: str, *, fence: int, outcome: str, external_id: str = "", result: Any = None
) -> Call[Action]:
    body = {
        "fence": fence,
        "outcome": outcome,
        "external_id": external_id,
        "result": as_api_json(result),
    }
    return post(at("actions", action_id, "outcome"), body, Action.from_json)


# Integers (and whole floats) beyond this lose digits in JavaScript and in the journal's
# canonical JSON; the API refuses them.
_SAFE = 2**53 - 1
_UNSENDABLE = re.compile("[\x00\ud800-\udfff]")


def as_api_json(value: Any) -> Any:
    """A service's answer as the API takes it: a number past ±2**53 (a 64-bit id) or NaN /
    Infinity as its text, a NUL or a lone surrogate as U+FFFD, tuples as lists.

    The answer reports an effect that happened: were it refused (400 malformed_request) the
    outcome could not be recorded at all, and the action would stay `sent` however often it
    was retried. Its id, the proof, is a separate field and goes as given."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value if abs(value) <= _SAFE else str(value)
    if isinstance(value, float):
        return value if math.isfinite(value) and abs(value) <= _SAFE else json.dumps(value)
    if isinstance(value, str):
        return _UNSENDABLE.sub("\ufffd", value)
    if isinstance(value, Mapping):
        return {as_api_json(str(k)): as_api_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [as_api_json(item) for item in value]
    return value  # not JSON at all: dumps says so, naming the type


def actions_page(**query: str | None) -> Call[Page[Action]]:
    return get("actions/", page_of(Action.from_json), filters(**query))


def get_approval(approval_id: str, wait: float | None = None) -> Call[Approval]:
    params, extra = wait_params(wait)
    return get(at("approvals", approval_id), Approval.from_json, params, extra)


def decide(
    approval_id: str,
    decision: str,
    *,
    action_hash: str,
    reason: str = "",
    edits: Mapping[str, Any] | None = None,
) -> Call[Approval]:
    body: dict[str, Any] = {"decision": decision, "action_hash": action_hash, "reason": reason}
    if edits is not None:
        body["edits"] = dict(edits)
    return post(
        at("approvals", approval_id, "decision"), body, Approval.from_json, replay_safe=True
    )


def resolve(action_id: str, outcome: str, *, external_id: str = "", note: str = "") -> Call[Action]:
    body = {"outcome": outcome, "external_id": external_id, "note": note}
    return post(at("actions", action_id, "resolve"), body, Action.from_json)


# --- what both clients are configured with ------------------------------------------------


class ClientSettings(TypedDict, total=False):
    """`timeout` (seconds per request, 10), and the retry policy: `retries` (4), `backoff`
    (0.5 s), `max_backoff` (20 s), `max_retry_after` (60 s) — see RetryPolicy."""

    timeout: float
    retries: int
    backoff: float
    max_backoff: float
    max_retry_after: float


class Configured:
    """The base URL, timeout and retry policy of `Client` and `AsyncClient`."""

    def __init__(self, base_url: str, token: str, **settings: Unpack[ClientSettings]) -> None:
        self.base_url = api_root(base_url)
        self.timeout = settings.get("timeout", 10.0)
        self.policy = RetryPolicy(
            settings.get("retries", 4),
            settings.get("backoff", 0.5),
            settings.get("max_backoff", 20.0),
            settings.get("max_retry_after", 60.0),
        )
        self._http_options: dict[str, Any] = {
            "base_url": self.base_url,
            "headers": default_headers(token),
            "timeout": self.timeout,
        }

    @property
    def retries(self) -> int:
        return self.policy.retries


# --- the retry policy --------------------------------------------------------------------


def retry_after(response: httpx.Response) -> float | None:
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


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries with exponential backoff and jitter, or what the server asked for.

    `retries` is how many times one logical call may be repeated; `backoff` the first pause,
    doubling up to `max_backoff`, each drawn with jitter so that many agents hit by the same
    outage do not come back in lockstep. A 429/503 whose Retry-After exceeds
    `max_retry_after` is raised rather than slept through.
    """

    retries: int = 4
    backoff: float = 0.5
    max_backoff: float = 20.0
    max_retry_after: float = 60.0

    def pause(
        self,
        call: Call[Any],
        attempt: int,
        *,
        response: httpx.Response | None = None,
        error: Failure | None = None,
    ) -> float:
        """How long to wait before attempt `attempt + 1` of a call that got `response` (not
        a success) or `error`; raises what the caller gets when it is not repeated."""
        if error is not None:
            delay = self.after_transport_error(call, error, attempt)
        else:
            assert response is not None
            delay = self.after_refusal(call, response, attempt)
        log.info("retrying %s %s in %.2fs (attempt %d)", call.method, call.path, delay, attempt + 1)
        return delay

    def after_transport_error(self, call: Call[Any], exc: Failure, attempt: int) -> float:
        """The pause before repeating a call whose request failed, or raise TransportError.

        An answer that cannot be decoded is one more failure after sending: the server may
        have applied the call, and what it said about that is unreadable."""
        sent = not isinstance(exc, NOT_SENT)
        if attempt < self._retries(call) and (call.replay_safe or not sent):
            return self._delay(call, attempt, None)
        what = type(exc).__name__
        if isinstance(exc, httpx.DecodingError):
            what += " (an answer whose body cannot be decoded)"
        raise TransportError(
            f"{call.method} {call.path}: {what}: {exc}",
            may_have_applied=sent and call.method != "GET",
        ) from exc

    def after_refusal(self, call: Call[Any], response: httpx.Response, attempt: int) -> float:
        """The pause before repeating a call the server refused, or raise its exception.

        A 5xx that is not Holdpoint's own answer (a gateway's 502/503/504, a crash page)
        does not say whether the request reached Holdpoint and was applied: for a call that
        is not safe to repeat it is the ambiguity of a lost connection, and raised as one
        (TransportError, may_have_applied) so the caller re-reads instead of guessing."""
        error = error_from_response(response)
        if attempt < self._retries(call) and retryable(error, call.replay_safe):
            wait = retry_after(response)
            if wait is None or wait <= self._longest_wait(call):
                return self._delay(call, attempt, wait)
        if not call.replay_safe and unanswered(error):
            raise TransportError(
                f"{call.method} {call.path}: HTTP {error.status} from in front of Holdpoint "
                "(not its API's answer): whether the call was applied cannot be told",
                may_have_applied=True,
            ) from error
        raise error

    def _retries(self, call: Call[Any]) -> int:
        return self.retries if call.retries is None else min(self.retries, call.retries)

    def _longest_wait(self, call: Call[Any]) -> float:
        """The longest Retry-After slept through for this call (a longer one is raised)."""
        if call.timeout is None:
            return self.max_retry_after
        return min(self.max_retry_after, call.timeout)

    def _delay(self, call: Call[Any], attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return retry_after
        ceiling = min(self.max_backoff, self.backoff * (2**attempt))
        if call.timeout is not None:
            ceiling = min(ceiling, call.timeout)
        return random.uniform(ceiling / 2, ceiling)


def retryable(error: HoldpointAPIError, replay_safe: bool) -> bool:
    """429 and a key still in flight always; Holdpoint's 503 `tool_unavailable` always (it
    refused before any work); other 5xx — Holdpoint's `service_unavailable` (its database
    was out of reach, perhaps after part of the call was committed), a gateway's 503 — only
    when repeating the call cannot apply it twice."""
    if isinstance(error, Throttled | IdempotencyKeyInFlight):
        return True
    if isinstance(error, ToolUnavailable) and error.said_by_holdpoint:
        return True
    return isinstance(error, ServerError) and replay_safe


def unanswered(error: HoldpointAPIError) -> bool:
    """A 5xx Holdpoint did not write: the request may or may not have reached it."""
    return isinstance(error, ServerError) and not error.said_by_holdpoint
