"""Prometheus metrics for operators: `GET /metrics` (API.md, "Metrics").

Two sources, chosen per metric for exactness:

- Counts of current rows (runs and actions by status, the reconcile backlog, pending
  approvals and the oldest one's age) and the lease takeovers the journal records (with
  those the retention purge redacted, kept in a Tally) are read from the database at
  scrape time. They are exact whichever process, host or restart did
  the work, and cost a fixed number of statements (four, whatever the data size).
- The two duration histograms are observed where the work happens (worker and web
  processes) in prometheus-client's multiprocess mode: each process writes its own small
  file under PROMETHEUS_MULTIPROC_DIR and a scrape sums them, dead processes included, so
  every process on a host counts once and a restart loses nothing (runtime.metricfiles
  folds the files of processes that are gone, so the directory stays small). Computing them from
  recorded timestamps instead would mean reading every step's journal entries on each
  scrape (the journal has no step start time; a step is not one row).

No `tenant` label: tenants are rows that grow without bound, and a label per tenant
multiplies every series by their number. Per-tenant counts are in the admin and the API.
The `tool` label is kept (API.md names it) but bounded: tenants define tools, so its values
are the first HOLDPOINT_METRICS_TOOL_LABELS tools a host met, each cut to 100 characters
(the longest an action's tool is), and `_other` (no tool name begins with `_`) for the rest.
"""

from __future__ import annotations

import functools
import hmac
import logging
import os
import time
from collections.abc import Collection, Iterable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import connection
from django.db.models import BooleanField, Count
from django.db.models.expressions import RawSQL
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from audit.models import JournalEntry
from runtime.events import RunEvent
from runtime.metricfiles import BoundedLabel, HostMetrics
from runtime.models import Action, ActionStatus, Run, RunStatus, Tally

log = logging.getLogger("holdpoint.metrics")

# From a local read to an LLM call or a slow tracker, up to the default step timeout.
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

STEP_SECONDS = Histogram(
    "holdpoint_step_duration_seconds",
    "Wall time of one step a worker executed and committed, its commit included.",
    buckets=_BUCKETS,
)
ACTION_METRIC = "holdpoint_action_duration_seconds"
ACTION_SECONDS = Histogram(
    ACTION_METRIC,
    "Wall time of one request to a tool's service (from `sent` to its answer).",
    ["tool"],
    buckets=_BUCKETS,
)
# Each value is a series in every process's memory and file, in every scrape and in the
# operator's Prometheus: a tenant defining tools by the thousand must not make them so many.
TOOL = BoundedLabel(ACTION_METRIC, "tool", other="_other", length=100)
# Waiting for reconciliation: the outcome is not known, by the reconciler or by a human.
BACKLOG = (ActionStatus.UNKNOWN, ActionStatus.MANUAL_REVIEW)

# The takeovers the journal records: `lease_taken` entries whose payload says `takeover`.
# Runtime migration 0022 gives this exact predicate a partial index (only takeovers are in
# it), so the count reads that small index, never the journal.
_TAKEOVER = {
    "postgresql": "payload @> '{\"takeover\": true}'",
    "sqlite": "json_extract(payload, '$.takeover') = 1",
}
# The takeovers whose entries the retention purge redacted (their payload is a digest now):
# a counter never goes down, so they stay counted here (runtime.models.Tally).
REDACTED_TAKEOVERS = "lease_takeovers_redacted"


def clock() -> float:
    return time.perf_counter()


def observe_step(began: float, ended: float | None = None) -> None:
    STEP_SECONDS.observe((time.perf_counter() if ended is None else ended) - began)


def observe_action(tool: str, began: float) -> None:
    _action_seconds(tool).observe(time.perf_counter() - began)


def observe_action_seconds(tool: str, seconds: float) -> None:
    """A request timed elsewhere: a `client` tool's, by the database's times."""
    _action_seconds(tool).observe(max(seconds, 0.0))


# ACTION_SECONDS's series by its `tool` label: what `labels()` finds again on every call (its
# arguments checked, a lock taken), found here in a dict — as bounded as the label's values.
_ACTION_SERIES: dict[str, Any] = {}


def _action_seconds(tool: str) -> Any:
    label = _tool_label(tool)
    series = _ACTION_SERIES.get(label)
    if series is None:
        series = _ACTION_SERIES[label] = ACTION_SECONDS.labels(tool=label)
    return series


def _tool_label(tool: str) -> str:
    return TOOL.value(_directory(), tool, settings.HOLDPOINT_METRICS_TOOL_LABELS)


def _directory() -> Path:
    """Where this process's histograms go (prometheus-client reads the same variable)."""
    return _path(os.environ["PROMETHEUS_MULTIPROC_DIR"])


@functools.lru_cache(maxsize=16)
def _path(directory: str) -> Path:
    return Path(directory)  # parsed once: this runs for every request an action sends


def takeovers_sql(vendor: str) -> str:
    """The takeovers journalled and those redacted since, in one statement: one snapshot, so
    a purge committing between two reads cannot count its takeovers twice, or not at all."""
    table, tally = JournalEntry._meta.db_table, Tally._meta.db_table
    journalled = f"SELECT COUNT(*) FROM {table} WHERE type = %s AND {_TAKEOVER[vendor]}"
    redacted = f"SELECT value FROM {tally} WHERE name = '{REDACTED_TAKEOVERS}'"
    return f"SELECT ({journalled}) + COALESCE(({redacted}), 0)"


def takeovers_in(streams: Collection[str]) -> dict[str, int]:
    """The takeovers journalled in these streams and not redacted yet, by stream."""
    takeover = RawSQL(_TAKEOVER[connection.vendor], (), output_field=BooleanField())
    entries = JournalEntry.objects.filter(
        stream__in=streams, type=RunEvent.LEASE_TAKEN, redacted=False
    ).filter(takeover)
    return dict(entries.order_by().values_list("stream").annotate(n=Count("pk")))


def keep_redacted_takeovers(takeovers: Mapping[str, int], refused: Collection[str]) -> None:
    """The retention purge, in its transaction, has redacted the streams `takeovers` counted
    (`takeovers_in`) except those it `refused`: the counter keeps their takeovers."""
    gone = sum(n for stream, n in takeovers.items() if stream not in refused)
    Tally.add(REDACTED_TAKEOVERS, gone)


def _by_status(name: str, doc: str, counts: dict[str, int], statuses: Iterable[str]) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=["status"])
    for status in statuses:  # every status, zeros too: a series never vanishes
        family.add_metric([status], counts.get(status, 0))
    return family


class DatabaseCollector(Collector):
    """Runs, actions and lease takeovers as the database says now."""

    def collect(self) -> Iterator[Metric]:
        runs = dict(Run.objects.order_by().values_list("status").annotate(n=Count("pk")))
        yield _by_status("holdpoint_runs", "Runs by status.", runs, RunStatus.values)
        actions = dict(Action.objects.order_by().values_list("status").annotate(n=Count("pk")))
        yield _by_status(
            "holdpoint_actions", "Ledger actions by status.", actions, ActionStatus.values
        )
        yield GaugeMetricFamily(
            "holdpoint_reconcile_backlog",
            "Actions whose outcome is not known yet (unknown or manual_review).",
            value=sum(actions.get(status, 0) for status in BACKLOG),
        )
        with connection.cursor() as cursor:
            cursor.execute(takeovers_sql(connection.vendor), [RunEvent.LEASE_TAKEN.value])
            (takeovers,) = cursor.fetchone()
        yield CounterMetricFamily(
            "holdpoint_lease_takeovers",
            "Leases taken from another executor whose lease had expired (journalled).",
            value=takeovers,
        )


# Collectors other apps add at start-up (approvals: pending requests), read on each scrape.
_collectors: list[Collector] = [DatabaseCollector()]


def add_collector(collector: Collector) -> None:
    _collectors.append(collector)


def registry() -> CollectorRegistry:
    """What one scrape reports: every process's histograms, then the database's counts."""
    scrape = CollectorRegistry(auto_describe=False)
    bounds = [(TOOL, settings.HOLDPOINT_METRICS_TOOL_LABELS)]
    scrape.register(HostMetrics(str(_directory()), bounds))
    for collector in _collectors:
        scrape.register(collector)
    return scrape


CHALLENGE = 'Bearer realm="metrics"'


def authorized(header: str) -> bool:
    """Whether an Authorization header value may read the metrics."""
    token = settings.HOLDPOINT_METRICS_TOKEN
    if not token:
        return True
    scheme, _, credential = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        credential.strip().encode(), token.encode()
    )


@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    if not authorized(request.headers.get("Authorization", "")):
        refused = HttpResponse(status=401)
        refused["WWW-Authenticate"] = CHALLENGE
        return refused
    return HttpResponse(generate_latest(registry()), content_type=CONTENT_TYPE_LATEST)


def serve(host: str, port: int) -> None:
    """`manage.py metrics_server`: the same answer as /metrics, for a host that runs workers
    and no web process (its processes' histograms are in its own directory)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
            elif not authorized(self.headers.get("Authorization", "")):
                self.send_response(401)
                self.send_header("WWW-Authenticate", CHALLENGE)
                self.send_header("Content-Length", "0")
                self.end_headers()
            else:
                try:
                    body = generate_latest(registry())
                except Exception:  # the database away: answered, and logged as the web does
                    log.exception("metrics_server: the scrape failed")
                    self.send_response(500)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                finally:
                    connection.close()  # this request's thread's own: it ends with it
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.info("metrics_server %s", format % args)

    ThreadingHTTPServer((host, port), Handler).serve_forever()
