"""Liveness, readiness, and the settings that would silently break a guarantee.

/healthz says the process answers. /readyz says it can do useful work: the database answers,
every migration is applied, and a worker cluster has published a heartbeat recently (a web
process without workers would accept runs that never move). Those three decide its status
code; the other checks here are reported in its details too, but do not take a web process
out of a load balancer — a misconfiguration is fixed by an operator, not by a restart.

`manage.py doctor` runs every check below and prints one line per problem: what is wrong,
why it matters, how to fix it. Each check is one function returning a result dict (`ok`,
and when not ok `level` and `problems`), shared by the command and the probe, so the two
can never disagree.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.migrations.executor import MigrationExecutor
from django.db.models import OuterRef, Subquery
from django.http import HttpRequest, JsonResponse
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.views.decorators.http import require_GET

Result = dict[str, Any]
ERROR, WARNING = "error", "warning"

# Leases and expiry compare against the database's clock, but django-q2's ORM-broker task
# locks use the app's, and a new approval's `expires_at` is set from it. Past this many
# seconds apart, a worker can take a task another still holds, and a request's time to
# decide is longer or shorter than its policy says. NTP keeps hosts within milliseconds; a
# second means the host has no time sync at all.
MAX_CLOCK_SKEW = 1.0
# A tool call must end well inside the lease: the lease is renewed at each commit and, with
# the heartbeat thread, every TTL/3. A call longer than TTL minus one heartbeat interval
# can still be in flight when another worker takes the run over after one missed beat; its
# outcome is then refused by the fence and has to be reconciled.
HEARTBEAT_MARGIN = 1 / 3
SQLITE = "django.db.backends.sqlite3"
POSTGRES = "django.db.backends.postgresql"


def _ok(**extra: Any) -> Result:
    return {"ok": True, **extra}


def _fail(problems: list[str], *, level: str = ERROR, **extra: Any) -> Result:
    return {"ok": False, "level": level, "problems": problems, **extra}


def _line(what: str, why: str, fix: str) -> str:
    return f"{what} — {why}. Fix: {fix}."


def _db() -> Any:
    return connections[DEFAULT_DB_ALIAS]


def _engine() -> str:
    return str(_db().settings_dict["ENGINE"])


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


# --- what /readyz's status code rests on -----------------------------------------------------


def check_database() -> Result:
    """The database answers, and takes writes: a PostgreSQL standby, read-only transactions
    or an SQLite connection that is query-only answer `SELECT 1` too — and refuse every
    run, decision and step commit."""
    try:
        with _db().cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
            why = _read_only(cursor)
    except Exception as exc:  # any driver error means "not reachable" to a probe
        detail = f"{type(exc).__name__}: {exc}".strip()[:200]
        return _fail([_unreachable(detail)], detail=detail, kind=type(exc).__name__)
    if why:
        fix = "point DATABASE_URL at the primary, or turn read-only off"
        problem = _line(f"the database takes no writes ({why})", "nothing can run", fix)
        return _fail([problem], detail=why, kind=READ_ONLY)
    return _ok()


READ_ONLY = "read_only"


def _read_only(cursor: Any) -> str:
    """Why the database takes no writes on this connection, or "" (one statement). Said
    without the database's name, address or file: /readyz shows it to anyone."""
    if _engine() == POSTGRES:
        # transaction_read_only: a standby's, and this transaction's; the default: the next
        # transactions' (ALTER DATABASE/ROLE … SET default_transaction_read_only).
        cursor.execute(
            "SELECT pg_is_in_recovery(), current_setting('transaction_read_only'),"
            " current_setting('default_transaction_read_only')"
        )
        standby, now, default = cursor.fetchone()
        if standby:
            return "a standby in recovery"
        return "read-only transactions" if "on" in (now, default) else ""
    cursor.execute("PRAGMA query_only")
    return "the connection is query-only" if cursor.fetchone()[0] else ""


def _unreachable(detail: str) -> str:
    return _line(f"database unreachable ({detail})", "nothing can run", "check DATABASE_URL")


def check_migrations() -> Result:
    try:
        executor = MigrationExecutor(_db())
        plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    except Exception as exc:
        return _fail(
            [f"migrations could not be read ({type(exc).__name__})"], detail=type(exc).__name__
        )
    pending = [f"{m.app_label}.{m.name}" for m, _ in plan]
    if pending:
        why = "the code expects tables and constraints the database does not have yet"
        return _fail(
            [_line(f"{len(pending)} migration(s) not applied", why, "python manage.py migrate")],
            pending=pending,
        )
    return _ok(pending=[])


def check_worker() -> Result:
    """A worker cluster's heartbeat: django-q2 refreshes each cluster's Stat in the "q"
    cache every guard cycle with a 3 s expiry (Redis, or files under var/)."""
    from django_q.status import Stat

    try:
        stats = Stat.get_all()
    except Exception as exc:  # a broken cache/broker is "no worker seen"
        return _fail([_no_worker(type(exc).__name__)], detail=type(exc).__name__)
    clusters = sorted({str(s.cluster_id) for s in stats})
    if not clusters:
        return _fail([_no_worker("")], clusters=[])
    return _ok(clusters=clusters)


def _no_worker(detail: str) -> str:
    seen = f" ({detail})" if detail else ""
    return _line(
        f"no worker cluster heartbeat in the last few seconds{seen}",
        "runs are accepted but never advance, and expired leases are never swept",
        "start `python manage.py qcluster` with the same REDIS_URL/HOLDPOINT_VAR_DIR as the web",
    )


# --- the queue ---------------------------------------------------------------------------------


def check_broker() -> Result:
    """The broker answers, and django-q2 is configured so it never runs a task twice at once
    or kills a worker mid-step."""
    from django_q.brokers import get_broker

    conf: dict[str, Any] = settings.Q_CLUSTER
    name = "redis" if conf.get("redis") else "orm"
    problems = []
    try:
        alive = bool(get_broker().ping())
    except Exception as exc:  # connection errors of Redis or the database
        alive, name = False, f"{name}: {type(exc).__name__}"
    if not alive:
        problems.append(
            _line(
                f"the queue broker ({name}) does not answer",
                "runs are never rung",
                "check REDIS_URL",
            )
        )
    timeout, retry = int(conf["timeout"]), int(conf.get("retry", 60))
    if conf.get("orm") and retry <= timeout:
        problems.append(
            _line(
                f"Q_CLUSTER retry ({retry} s) is not above timeout ({timeout} s)",
                "the ORM broker hands a task still running to a second worker",
                "keep retry = HOLDPOINT_TASK_TIMEOUT + 60 (config/settings.py)",
            )
        )
    if settings.HOLDPOINT_SLICE_SECONDS >= timeout:
        problems.append(
            _line(
                f"HOLDPOINT_SLICE_SECONDS ({settings.HOLDPOINT_SLICE_SECONDS}) is not below "
                f"HOLDPOINT_TASK_TIMEOUT ({timeout})",
                "django-q2 kills a worker in the middle of a step it was allowed to take",
                "raise HOLDPOINT_TASK_TIMEOUT or lower HOLDPOINT_SLICE_SECONDS",
            )
        )
    return _fail(problems, broker=name) if problems else _ok(broker=name)


# --- the database ------------------------------------------------------------------------------


def check_durability() -> Result:
    """A commit the database acknowledged survives a power loss. Holdpoint writes `sent`
    and commits before it calls a tool: if that commit could vanish, `prepared` would no
    longer mean "certainly not sent" and an action could be sent twice."""
    engine = _engine()
    if engine == SQLITE:
        return _sqlite_durability()
    if engine == POSTGRES:
        return _postgres_durability()
    return _fail([f"database engine {engine} is not one Holdpoint supports"])


def _pragma(name: str) -> str:
    with _db().cursor() as cursor:
        cursor.execute(f"PRAGMA {name}")
        return str(cursor.fetchone()[0]).lower()


def _sqlite_durability() -> Result:
    journal, synchronous = _pragma("journal_mode"), _pragma("synchronous")
    problems = []
    if journal != "wal":
        problems.append(
            _line(
                f"SQLite journal_mode is {journal}, not wal",
                "readers block the writer and a worker's commit waits behind every page load",
                "keep `PRAGMA journal_mode=WAL` in the init_command (config/settings.py)",
            )
        )
    if synchronous not in ("2", "3"):  # FULL, EXTRA
        problems.append(
            _line(
                f"SQLite synchronous is {synchronous} (FULL is 2)",
                "a power loss can undo the last commits, so a `sent` mark can vanish",
                "keep `PRAGMA synchronous=FULL` in the init_command (config/settings.py)",
            )
        )
    found = {"journal_mode": journal, "synchronous": synchronous}
    return _fail(problems, **found) if problems else _ok(**found)


# PostgreSQL settings that must be on, and what turning each off costs.
_PG_DURABLE = {
    "fsync": "the server does not flush its WAL: a crash can corrupt or lose committed data",
    "synchronous_commit": "a commit is acknowledged before its WAL is flushed: a crash "
    "loses the last commits, so a `sent` mark can vanish",
    "full_page_writes": "a crash during a page write can leave torn pages that recovery "
    "cannot repair",
}


def _postgres_durability() -> Result:
    found = {}
    with _db().cursor() as cursor:
        for name in _PG_DURABLE:
            cursor.execute(f"SHOW {name}")
            found[name] = str(cursor.fetchone()[0]).lower()
    # `local`, `remote_write`, `remote_apply` still flush the local WAL before acknowledging.
    problems = [
        _line(
            f"PostgreSQL {name} is off",
            why,
            f"`ALTER SYSTEM SET {name} = on` (and remove any per-role/database SET)",
        )
        for name, why in _PG_DURABLE.items()
        if found[name] == "off"
    ]
    return _fail(problems, **found) if problems else _ok(**found)


def check_connections() -> Result:
    """Workers keep their database connection: with CONN_MAX_AGE=0 each task opens a new
    one (the ORM broker on PostgreSQL ran 30 instead of 294 tasks/s, NOTES.md), and a
    kept connection needs health checks so a database restart does not fail the next task."""
    db = _db().settings_dict
    # The workers' value: this process may be the ASGI web, which keeps none (config/asgi.py).
    kept = settings.HOLDPOINT_WORKER_CONN_MAX_AGE
    if db["ENGINE"] != POSTGRES:  # SQLite opens a file: nothing to keep
        return _ok(conn_max_age=kept)
    problems = []
    if kept == 0:
        problems.append(
            _line(
                "CONN_MAX_AGE is 0 on PostgreSQL",
                "every queue task opens a connection: about a tenth of the worker throughput",
                "unset DB_CONN_MAX_AGE (600) or set it above 0",
            )
        )
    if not db.get("CONN_HEALTH_CHECKS"):
        problems.append(
            _line(
                "CONN_HEALTH_CHECKS is off with persistent connections",
                "after a database restart each worker's next task fails on a dead connection",
                "set CONN_HEALTH_CHECKS = True (config/settings.py)",
            )
        )
    extra: dict[str, Any] = {
        "conn_max_age": kept,
        "health_checks": db.get("CONN_HEALTH_CHECKS"),
    }
    return _fail(problems, **extra) if problems else _ok(**extra)


def _database_now() -> datetime:
    with _db().cursor() as cursor:
        if _engine() == POSTGRES:
            cursor.execute("SELECT clock_timestamp()")  # now() is the transaction's start
            value = cursor.fetchone()[0]
        else:
            # SQLite asks the operating system, not Python (time-machine does not move it).
            cursor.execute("SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')")
            value = parse_datetime(cursor.fetchone()[0] + "+00:00")
    assert isinstance(value, datetime)
    return value


def check_clock() -> Result:
    before = time.monotonic()
    app = timezone.now()
    db = _database_now()
    # Half the round trip is when the database most likely read its clock.
    skew = (db - app).total_seconds() - (time.monotonic() - before) / 2
    extra: dict[str, Any] = {"skew_seconds": round(skew, 3), "max_seconds": MAX_CLOCK_SKEW}
    if abs(skew) <= MAX_CLOCK_SKEW:
        return _ok(**extra)
    return _fail(
        [
            _line(
                f"the app's clock is {abs(skew):.1f} s {'behind' if skew > 0 else 'ahead of'} "
                f"the database's (at most {MAX_CLOCK_SKEW:g} s)",
                "approval expiry and django-q2's task locks disagree with the leases",
                "run NTP (chrony, systemd-timesyncd) on the app and database hosts",
            )
        ],
        **extra,
    )


# --- secrets ------------------------------------------------------------------------------------


def check_secret_keys() -> Result:
    """Tool credentials are encrypted with HOLDPOINT_SECRET_KEYS: without keys nothing can
    be stored, and a credential no configured key opens fails every call that sends it."""
    from runtime.crypto import SecretUnreadable
    from runtime.models import ToolCredential

    if not settings.HOLDPOINT_SECRET_KEYS:
        why = "tool credentials can be neither stored nor read"
        fix = "set HOLDPOINT_SECRET_KEYS to comma-separated Fernet keys, newest first"
        return _fail([_line("HOLDPOINT_SECRET_KEYS is empty", why, fix)], keys=0)
    unreadable = []
    for credential in ToolCredential.objects.exclude(ciphertext="").select_related("tenant"):
        try:
            credential.secret()
        except SecretUnreadable:
            unreadable.append(f"{credential.tenant.slug}/{credential.service}")
    keys = len(settings.HOLDPOINT_SECRET_KEYS)
    if not unreadable:
        return _ok(keys=keys)
    return _fail(
        [
            _line(
                f"tool credential(s) {', '.join(unreadable)} open with none of the keys",
                "every call of a tool that sends them fails",
                "put the key they were stored with back into HOLDPOINT_SECRET_KEYS "
                "(`manage.py rotate_secrets` re-encrypts), or store them again",
            )
        ],
        keys=keys,
    )


# --- tools --------------------------------------------------------------------------------------


def _tools() -> list[tuple[str, str, dict[str, Any]]]:
    """(tenant slug or "built-in", name, definition) of every current tool: the
    deployment's built-in ones and each active tenant's highest versions, in two queries
    whatever the number of tenants (/readyz runs this on every probe)."""
    from runtime.models import ToolDefinition
    from runtime.tooldefs import builtin_specs

    newest = ToolDefinition.objects.filter(
        tenant_id=OuterRef("tenant_id"), name=OuterRef("name")
    ).order_by("-version")
    rows = (
        ToolDefinition.objects.filter(tenant__active=True)
        .filter(version=Subquery(newest.values("version")[:1]))
        .order_by("tenant__slug", "name")
        .values_list("tenant__slug", "name", "spec")
    )
    return [("built-in", name, spec) for name, spec in builtin_specs().items()] + list(rows)


def _sent_by_holdpoint() -> list[tuple[str, str, dict[str, Any]]]:
    """Tools a worker sends itself (`client` tools are sent by an external executor,
    under its own lease)."""
    return [item for item in _tools() if item[2].get("executor") != "client"]


def check_tool_timeouts() -> Result:
    ttl = float(settings.HOLDPOINT_LEASE_TTL)
    limit = ttl * (1 - HEARTBEAT_MARGIN)
    over = [
        f"{owner}/{name} ({float(spec.get('timeout_seconds', 5)):g} s)"
        for owner, name, spec in _sent_by_holdpoint()
        if float(spec.get("timeout_seconds", 5)) > limit
    ]
    extra: dict[str, Any] = {"lease_ttl": ttl, "max_timeout": round(limit, 2)}
    if not over:
        return _ok(**extra)
    return _fail(
        [
            _line(
                f"tool timeout(s) above {limit:g} s (HOLDPOINT_LEASE_TTL {ttl:g} s less one "
                f"heartbeat interval): {', '.join(over)}",
                "a call can outlive the worker's lease; the run is taken over while the "
                "request is in flight and its outcome must be reconciled",
                "lower the tools' timeout_seconds or raise HOLDPOINT_LEASE_TTL",
            )
        ],
        **extra,
    )


def check_write_policies() -> Result:
    """A tenant's write or irreversible tool that no active policy names is held for the
    tenant's reviewers by default (safe), but the admin probably meant to say who decides.
    (Built-in tools declare their own approval.)"""
    from runtime import gates
    from runtime.models import Tenant
    from runtime.tools import changes_something

    tenants = dict(Tenant.objects.filter(active=True).values_list("slug", "pk"))
    named: dict[str, set[str]] = {}
    unnamed = []
    for owner, name, spec in _tools():
        if owner == "built-in" or not changes_something(spec):
            continue
        if owner not in named:
            named[owner] = gates.tools_named_by_policy(tenants[owner])
        if name not in named[owner]:
            unnamed.append(f"{owner}/{name}")
    if not unnamed:
        return _ok()
    return _fail(
        [
            _line(
                f"write tool(s) no approval policy names: {', '.join(unnamed)}",
                "each of their actions waits for any reviewer of the tenant (held by default)",
                "add an approval policy for each in the admin (one with required off lets "
                "it run unheld)",
            )
        ],
        level=WARNING,
        tools=unnamed,
    )


def check_tool_hosts() -> Result:
    http = [(o, n) for o, n, spec in _tools() if spec.get("executor") == "http"]
    if settings.HOLDPOINT_TOOL_HOSTS or not http:
        return _ok(hosts=len(settings.HOLDPOINT_TOOL_HOSTS))
    names = ", ".join(f"{owner}/{name}" for owner, name in http[:5])
    more = f" and {len(http) - 5} more" if len(http) > 5 else ""
    return _fail(
        [
            _line(
                f"HOLDPOINT_TOOL_HOSTS is empty while http tools exist ({names}{more})",
                "every call of them is refused at send time",
                "list the hosts those tools call in HOLDPOINT_TOOL_HOSTS",
            )
        ],
        hosts=0,
    )


_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]", "testserver"}


def check_debug() -> Result:
    exposed = [h for h in settings.ALLOWED_HOSTS if h not in _LOCAL_HOSTS]
    if not settings.DEBUG or not exposed:
        return _ok(debug=settings.DEBUG)
    return _fail(
        [
            _line(
                f"DEBUG is on while ALLOWED_HOSTS names {', '.join(exposed)}",
                "error pages show settings and tracebacks to anyone, webhooks may reach "
                "private addresses and outbound tools localhost",
                "set DEBUG=0 (and SECRET_KEY, HOLDPOINT_SECRET_KEYS) on a reachable host",
            )
        ],
        debug=True,
    )


def check_metrics() -> Result:
    """/metrics answers anyone who reaches it unless HOLDPOINT_METRICS_TOKEN is set: counts
    of runs, actions and approvals (no tenant's names), but a figure of the business all the
    same. Said as a warning on a host others can reach; a local setup needs no token."""
    exposed = [h for h in settings.ALLOWED_HOSTS if h not in _LOCAL_HOSTS]
    if settings.HOLDPOINT_METRICS_TOKEN or not exposed:
        return _ok(token=bool(settings.HOLDPOINT_METRICS_TOKEN))
    return _fail(
        [
            _line(
                f"/metrics needs no token while ALLOWED_HOSTS names {', '.join(exposed)}",
                "anyone who reaches the web port reads the deployment's run, action and "
                "approval figures",
                "set HOLDPOINT_METRICS_TOKEN (Prometheus: authorization.credentials), or "
                "serve /metrics only to the scraper's network",
            )
        ],
        level=WARNING,
        token=False,
    )


# --- all of them ---------------------------------------------------------------------------------

# The checks /readyz's status code rests on (its contract since the first release).
READINESS = ("database", "migrations", "worker")
CHECKS: dict[str, Callable[[], Result]] = {
    "database": check_database,
    "migrations": check_migrations,
    "worker": check_worker,
    "broker": check_broker,
    "durability": check_durability,
    "connections": check_connections,
    "clock": check_clock,
    "secret_keys": check_secret_keys,
    "tool_timeouts": check_tool_timeouts,
    "write_policies": check_write_policies,
    "tool_hosts": check_tool_hosts,
    "debug": check_debug,
    "metrics": check_metrics,
}
# Checks that read settings only, and so still answer with the database down.
_WITHOUT_DATABASE = {"database", "worker", "connections", "debug", "metrics"}


def run_checks() -> dict[str, Result]:
    results = {"database": check_database()}
    for name, check in CHECKS.items():
        if name in results:
            continue
        if not results["database"]["ok"] and name not in _WITHOUT_DATABASE:
            results[name] = _fail([], detail="database unreachable")
            continue
        try:
            results[name] = check()
        except Exception as exc:  # one broken check must not hide the others
            results[name] = _fail([f"the check itself failed ({type(exc).__name__}: {exc})"])
    return results


def problems(results: dict[str, Result]) -> list[tuple[str, str, str]]:
    """(level, check, line) of every problem, in check order."""
    return [
        (result.get("level", ERROR), name, line)
        for name, result in results.items()
        for line in result.get("problems", [])
    ]


# /readyz answers anyone who can reach it: checks of the deployment show their problems, the
# checks that read tenants' tools and credentials say only how many (`manage.py doctor`
# names them), so no tenant's names leak to a probe — nor the database's address and user.
DEPLOYMENT_CHECKS = {
    "database",
    "migrations",
    "worker",
    "broker",
    "durability",
    "connections",
    "clock",
    "debug",
    "metrics",
}


def _public(name: str, result: dict[str, Any]) -> dict[str, Any]:
    if name == "database" and not result["ok"] and result.get("kind") != READ_ONLY:
        # The driver's message names the database's host, port, user and database (and why
        # the login failed): the class of the error is all a probe is told; doctor says more.
        kind = str(result.get("kind", "error"))
        return {**result, "detail": kind, "problems": [_unreachable(kind)], "kind": kind}
    if name in DEPLOYMENT_CHECKS:
        return result
    count = len(result.get("problems", []))
    problems = [f"{count} problem(s) in tenants' tools: run manage.py doctor"] if count else []
    return {"ok": result["ok"], "problems": problems}


@require_GET
def readyz(request: HttpRequest) -> JsonResponse:
    checks = {name: _public(name, result) for name, result in run_checks().items()}
    ready = all(checks[name]["ok"] for name in READINESS)
    return JsonResponse(
        {"status": "ok" if ready else "unavailable", "checks": checks}, status=200 if ready else 503
    )
