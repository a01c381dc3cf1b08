"""The tenant audit log page on a million journal entries in PostgreSQL: server time per filter.

    BENCH_POSTGRES_URL=postgres://postgres@127.0.0.1:5432/postgres \\
        .venv/bin/python bench/audit_log.py --entries 1000000
    # or as a step of the other benchmarks:
    BENCH_POSTGRES_URL=... .venv/bin/python bench/run.py --audit-entries 1000000

In a scratch database `holdpoint_bench_audit_<pid>` (created, migrated, dropped at the end;
your database is never touched) it writes N journal entries across 20 tenants with one
INSERT … SELECT generate_series, VACUUM ANALYZEs the table, then asks the real view
(`runtime.pages.audit.audit_log`) through Django's test Client — the whole request path,
middleware, session, tenant lookup, query, template, without a network — for each filter
kind and for page 2 via `?before=`, as a reviewer of the largest tenant and, interleaved
(A B A B …), as a reviewer of an almost empty tenant: the baseline. Reported: median, p90 and
extremes of 20 requests per case, the ratio to the baseline, SQL statements per request, and
EXPLAIN (ANALYZE, BUFFERS) of the page's main query. Writes bench/results/audit_log.json and
audit_log.md. See bench/README.md, "bench/audit_log.py".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script
from bench.common import (
    RESULTS,
    fmt,
    git_state,
    log,
    postgres_admin_url,
    setup_django,
    with_dbname,
)

TENANTS = 20
BIG, BASELINE = 1, 20  # tenant numbers: the largest (a quarter of all entries), almost empty
RUN_LENGTH = 20  # journal entries per run
IN_FLIGHT = 500  # runs whose entries interleave, as concurrent runs' do
SPAN_DAYS = 180
THRESHOLD_MS = 100.0

# Each run writes RUN_LENGTH entries; which one a position is decides its type and actor.
RUN_TYPES = """CASE
    WHEN pos = 0 THEN 'run_created'
    WHEN pos = 1 THEN 'lease_taken'
    WHEN pos = {last} THEN 'lease_released'
    WHEN pos = 9 THEN 'action_prepared'
    WHEN pos = 10 THEN 'approval_requested'
    WHEN pos = 11 THEN 'approval_decided'
    WHEN pos = 12 THEN 'action_outcome'
    WHEN mod(pos, 4) = 3 THEN 'call_recorded'
    ELSE 'step_committed' END"""
TENANT_TYPES = """(ARRAY['approval_decided', 'approval_decided', 'approval_decided', 'login',
    'approval_decided', 'login', 'policy_changed', 'audit_exported', 'action_resolved',
    'token_created'])[mod(key, 10) + 1]"""

# One statement: every column derived from g (the id), so no round trip per row and ids
# grow with created_at as they do in production. A run's entries are spread over
# IN_FLIGHT × RUN_LENGTH ids (runs interleave); every 25th id is a tenant-stream act.
# The tenant of a run (or act) is its key: one in 5000 goes to the baseline tenant, a
# quarter to the big one, the rest spread over 18 others. seq is numbered per stream.
GENERATE = f"""
INSERT INTO audit_journalentry
    (id, stream, seq, tenant_id, type, actor, object_ref, payload, created_at,
     prev_hash, hash, redacted)
SELECT g, stream, row_number() OVER (PARTITION BY stream ORDER BY g), tenant_id, type, actor,
       object_ref, payload, created_at, md5((g - 1)::text) || md5((g + 7)::text),
       md5(g::text) || md5((g + 8)::text), false
FROM (
    SELECT g, t.pk AS tenant_id, created_at,
        CASE WHEN act THEN 'tenant:' || t.pk ELSE 'run:' || run_id END AS stream,
        CASE WHEN act THEN {TENANT_TYPES} ELSE {RUN_TYPES.format(last=RUN_LENGTH - 1)} END AS type,
        CASE
            WHEN act AND mod(key, 10) = 6 THEN 'user:t' || t.no || '-admin'
            WHEN act THEN 'user:t' || t.no || '-rev' || mod(key, 5)
            WHEN pos = 0 THEN 'agent:t' || t.no || '-agent'
            WHEN pos = 11 THEN 'user:t' || t.no || '-rev' || mod(key, 5)
            ELSE 'worker:w-' || mod(key, 8) END AS actor,
        CASE
            WHEN NOT act THEN 'run:' || run_id
            WHEN mod(key, 10) = 6 THEN 'approvalpolicy:' || mod(key, 7)
            ELSE '' END AS object_ref,
        CASE WHEN act THEN jsonb_build_object(
                'run_id', run_id, 'decision', 'approved', 'reason', 'looks right to me',
                'ip', '10.0.' || mod(g, 250) || '.' || mod(g, 97))
            ELSE jsonb_build_object(
                'step', 'step-' || pos, 'status', 'running', 'fence', mod(key, 7) + 1,
                'digest', md5(g::text) || md5(key::text)) END AS payload
    FROM (
        SELECT g, act, pos, key, md5('run' || key)::uuid::text AS run_id,
            %(start)s::timestamptz + g * %(step_us)s * interval '1 microsecond' AS created_at,
            CASE WHEN mod(key, 5000) = 7 THEN {BASELINE}
                 WHEN mod(key, 4) = 0 THEN {BIG}
                 ELSE 2 + mod(key, 18) END AS tno
        FROM (
            SELECT g, mod(g, 25) = 0 AS act,
                mod(g - 1, {IN_FLIGHT} * {RUN_LENGTH}) / {IN_FLIGHT} AS pos,
                CASE WHEN mod(g, 25) = 0 THEN g / 25
                     ELSE ((g - 1) / ({IN_FLIGHT} * {RUN_LENGTH})) * {IN_FLIGHT}
                          + mod(g - 1, {IN_FLIGHT}) END AS key
            FROM generate_series(1, %(n)s::bigint) AS g
        ) keys
    ) cols
    JOIN (SELECT unnest(%(pks)s::bigint[]) AS pk, unnest(%(nos)s::text[]) AS no,
                 generate_series(1, {TENANTS}) AS tno) t USING (tno)
) generated
"""


def tenant_no(n: int) -> str:
    return f"{n:02d}"


def run_uuid_sql(key: int) -> str:
    return f"md5('run{key}')::uuid::text"


@dataclass
class Case:
    """One page of the log: its query string, for the big tenant and for the baseline."""

    name: str
    params: dict[str, str]
    page_2: bool = False  # add ?before= the last id of this case's own page 1

    baseline_params: dict[str, str] = field(default_factory=dict)


def cases(big_run: str, baseline_run: str, day: str, deep_before: int) -> list[Case]:
    week_end = (datetime.fromisoformat(day) + timedelta(days=6)).date().isoformat()
    quarter_end = (datetime.fromisoformat(day) + timedelta(days=89)).date().isoformat()
    rev = {"actor": f"user:t{tenant_no(BIG)}-rev2"}
    worker = {"actor": "worker:w-4"}
    return [
        Case("no filter", {}),
        Case("no filter, page 2", {}, page_2=True),
        Case("no filter, a page 95% back", {"before": str(deep_before)}),
        Case("actor (a reviewer)", rev, baseline_params={"actor": "user:t20-rev2"}),
        Case("actor (a reviewer), page 2", rev, True, {"actor": "user:t20-rev2"}),
        Case("actor (a worker)", worker, baseline_params={"actor": "worker:w-7"}),
        Case("type (approval_decided)", {"type": "approval_decided"}),
        Case("type (approval_decided), page 2", {"type": "approval_decided"}, page_2=True),
        Case("type (step_committed)", {"type": "step_committed"}),
        Case("object (an old run)", {"object": big_run}, baseline_params={"object": baseline_run}),
        Case("period (one day, 4 months ago)", {"from": day, "to": day}),
        Case("period (one day), page 2", {"from": day, "to": day}, page_2=True),
        Case("period (a week) + type", {"from": day, "to": week_end, "type": "policy_changed"}),
        Case(
            "period (90 days) + actor (a worker)",
            {"from": day, "to": quarter_end, **worker},
            baseline_params={"from": day, "to": quarter_end, "actor": "worker:w-7"},
        ),
        Case(
            "period (a week) + actor",
            {"from": day, "to": week_end, **rev},
            baseline_params={"from": day, "to": week_end, "actor": "user:t20-rev2"},
        ),
    ]


# --- setup -----------------------------------------------------------------------------------


def prepare(entries: int) -> dict[str, Any]:
    """Tenants, two reviewers, N entries; returns what the cases need and what it cost."""
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connection

    from runtime.models import Membership, Role, Tenant

    started = time.perf_counter()
    call_command("migrate", verbosity=0, interactive=False)
    migrated = time.perf_counter() - started
    tenants = [
        Tenant.objects.create(slug=f"bench-{tenant_no(n)}", name=f"Bench {n}")
        for n in range(1, TENANTS + 1)
    ]
    users = {}
    for n in (BIG, BASELINE):
        user = get_user_model().objects.create_user(username=f"reviewer-{tenant_no(n)}")
        Membership.objects.create(tenant=tenants[n - 1], user=user, role=Role.REVIEWER)
        users[n] = user
    start = datetime.now(UTC) - timedelta(days=SPAN_DAYS)
    step_us = SPAN_DAYS * 86_400 * 1_000_000 // entries
    params = {
        "n": entries,
        "start": start,
        "step_us": step_us,
        "pks": [t.pk for t in tenants],
        "nos": [tenant_no(n) for n in range(1, TENANTS + 1)],
    }
    timings: dict[str, float] = {"migrate_s": migrated}
    with connection.cursor() as cur:
        began = time.perf_counter()
        cur.execute(GENERATE, params)
        # Stream heads, as append() keeps them: later appends (the login, an export) go on.
        cur.execute(
            "INSERT INTO audit_streamhead (stream, tenant_id, seq, hash)"
            " SELECT DISTINCT ON (stream) stream, tenant_id, seq, hash"
            " FROM audit_journalentry ORDER BY stream, seq DESC"
        )
        timings["insert_s"] = time.perf_counter() - began
        cur.execute(
            "SELECT setval(pg_get_serial_sequence('audit_journalentry', 'id'), %s)", [entries]
        )
        began = time.perf_counter()
        # What autovacuum would have done to a table this old: statistics and the
        # visibility map (index-only scans), so the plans are the production ones.
        cur.execute("VACUUM (ANALYZE) audit_journalentry")
        timings["vacuum_analyze_s"] = time.perf_counter() - began
        cur.execute(
            "SELECT tenant_id, count(*) FROM audit_journalentry GROUP BY tenant_id"
            " ORDER BY count(*) DESC"
        )
        per_tenant = dict(cur.fetchall())
        cur.execute(
            "SELECT pg_total_relation_size('audit_journalentry'),"
            " pg_relation_size('audit_journalentry')"
        )
        total_bytes, heap_bytes = cur.fetchone()
        # An old run of each (the first block), and a day four months back.
        big_key = next(k for k in range(4, 10_000, 4) if k % 5000 != 7)
        cur.execute(f"SELECT {run_uuid_sql(big_key)}, {run_uuid_sql(7)}")
        big_run, baseline_run = cur.fetchone()
    day = (datetime.now(UTC) - timedelta(days=120)).date().isoformat()
    return {
        "users": users,
        "tenants": tenants,
        "timings": timings,
        "big_run": f"run:{big_run}",
        "baseline_run": f"run:{baseline_run}",
        "day": day,
        "deep_before": entries // 20,
        "data": {
            "entries": entries,
            "tenants": TENANTS,
            "big_tenant_entries": per_tenant[tenants[BIG - 1].pk],
            "baseline_tenant_entries": per_tenant[tenants[BASELINE - 1].pk],
            "largest_other_tenant_entries": max(
                v for k, v in per_tenant.items() if k != tenants[BIG - 1].pk
            ),
            "span_days": SPAN_DAYS,
            "table_total_bytes": total_bytes,
            "table_heap_bytes": heap_bytes,
            **timings,
        },
    }


# --- measuring -------------------------------------------------------------------------------


def cursor_for(user: Any, params: dict[str, str]) -> str | None:
    """?before= for page 2: the last id on page 1, from the view's own function (None when
    page 1 is empty, as it can be for the baseline tenant)."""
    from runtime.pages.audit import log_page, parse_filters
    from runtime.tenancy import principal_for

    principal = principal_for(user)
    assert principal is not None
    filters, problems = parse_filters(_query(params))
    assert not problems, problems
    page = log_page(principal, filters, None)
    return str(page.rows[-1].entry.pk) if page.rows else None


def _query(params: dict[str, str]) -> Any:
    from django.http import QueryDict

    q = QueryDict(mutable=True)
    q.update(params)
    return q


def explain(user: Any, params: dict[str, str]) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) of the page's main query (its parts, for an object), and
    what the plans scan."""
    from runtime.pages.audit import log_query, parse_before, parse_filters
    from runtime.tenancy import principal_for

    principal = principal_for(user)
    assert principal is not None
    query = _query(params)
    filters, _ = parse_filters(query)
    queries = log_query(principal, filters, parse_before(query.get("before")))
    plans = [q.explain(analyze=True, buffers=True) for q in queries]
    plan = "\n".join(plans)
    # Per plan: its first Buffers line is its top node's (all of the plan's reads).
    found = [re.search(r"Buffers: shared hit=(\d+)(?: read=(\d+))?", p) for p in plans]
    times = [re.search(r"Execution Time: ([\d.]+) ms", p) for p in plans]
    scans = re.findall(
        r"((?:Parallel )?(?:Index Only Scan|Index Scan|Seq Scan|Bitmap \w+ Scan)"
        r"(?: Backward)?(?: using \w+)?(?: on \w+)?)",
        plan,
    )
    return {
        "scans": scans,
        "index_scans_only": bool(scans) and all("Index" in s for s in scans),
        # A sort over the matching rows (bounded by LIMIT or not) vs PostgreSQL's incremental
        # sort of an index order by its tie-breaker (id among equal created_at).
        "sort": (
            "incremental"
            if "Incremental Sort" in plan
            else "top-N"
            if "top-N heapsort" in plan
            else "full"
            if re.search(r"->  Sort|^Sort", plan, re.MULTILINE)
            else ""
        ),
        "execution_ms": sum(float(t.group(1)) for t in times if t) if any(times) else None,
        "shared_hit": sum(int(b.group(1)) for b in found if b) if any(found) else None,
        "shared_read": sum(int(b.group(2) or 0) for b in found if b) if any(found) else None,
        "plan": plan,
    }


def timed_get(client: Any, url: str) -> tuple[float, bytes]:
    began = time.perf_counter()
    response = client.get(url)
    elapsed = (time.perf_counter() - began) * 1000
    if response.status_code != 200:
        raise SystemExit(f"{url}: HTTP {response.status_code}")
    return elapsed, response.content


def queries_of(client: Any, url: str) -> dict[str, Any]:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as captured:
        client.get(url)
    times = [float(q["time"]) * 1000 for q in captured.captured_queries]
    return {"statements": len(times), "slowest_statement_ms": max(times) if times else 0.0}


def spread_of(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "median": statistics.median(ordered),
        "p90": ordered[max(0, int(len(ordered) * 0.9 + 0.5) - 1)],
        "min": ordered[0],
        "max": ordered[-1],
    }


def measure(setup: dict[str, Any], repeat: int) -> list[dict[str, Any]]:
    from urllib.parse import urlencode

    from django.test import Client
    from django.urls import reverse

    clients = {}
    for n in (BIG, BASELINE):
        clients[n] = Client()
        clients[n].force_login(setup["users"][n])
    results = []
    for case in cases(setup["big_run"], setup["baseline_run"], setup["day"], setup["deep_before"]):
        params = {BIG: dict(case.params), BASELINE: dict(case.baseline_params or case.params)}
        if case.name.startswith("no filter, a page"):
            # The baseline's ids are spread over the same range: the same position.
            params[BASELINE] = dict(case.params)
        if case.page_2:
            for n in (BIG, BASELINE):
                before = cursor_for(setup["users"][n], params[n])
                if before is not None:
                    params[n]["before"] = before
            assert "before" in params[BIG], f"{case.name}: page 1 is empty"
        urls = {n: reverse("audit-log") + "?" + urlencode(params[n]) for n in (BIG, BASELINE)}
        for n in (BIG, BASELINE):
            for _ in range(3):  # warm-up: caches, the first plan
                timed_get(clients[n], urls[n])
        samples: dict[int, list[float]] = {BIG: [], BASELINE: []}
        rows: dict[int, int] = {}
        for _ in range(repeat):
            for n in (BIG, BASELINE):  # interleaved: A B A B …
                ms, content = timed_get(clients[n], urls[n])
                samples[n].append(ms)
                rows[n] = content.count(b' id="entry-')  # shown alone or in a folded group
        ratios = [a / b for a, b in zip(samples[BIG], samples[BASELINE], strict=True)]
        result = {
            "case": case.name,
            "params": params[BIG],
            "baseline_params": params[BASELINE],
            "big_ms": spread_of(samples[BIG]),
            "baseline_ms": spread_of(samples[BASELINE]),
            "ratio_of_medians": statistics.median(samples[BIG])
            / statistics.median(samples[BASELINE]),
            "ratio_per_round": spread_of(ratios),
            "rows": rows[BIG],
            "baseline_rows": rows[BASELINE],
            "big_queries": queries_of(clients[BIG], urls[BIG]),
            "baseline_queries": queries_of(clients[BASELINE], urls[BASELINE]),
            "explain": explain(setup["users"][BIG], params[BIG]),
            "under_threshold": statistics.median(samples[BIG]) < THRESHOLD_MS,
        }
        log(
            f"  {case.name}: {result['big_ms']['median']:.1f} ms "
            f"(baseline {result['baseline_ms']['median']:.1f} ms, "
            f"×{result['ratio_of_medians']:.2f}), {rows[BIG]} rows, "
            f"{', '.join(result['explain']['scans'])}"
        )
        results.append(result)
    return results


# --- the run ---------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    import django
    import psycopg
    from django.db import connection

    env: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "django": django.get_version(),
        "psycopg": psycopg.__version__,
        "debug_cursor": False,
        **git_state(),
    }
    with connection.cursor() as cur:
        for name in ("server_version", "shared_buffers", "work_mem", "random_page_cost"):
            cur.execute(f"SHOW {name}")
            env[f"pg_{name}"] = cur.fetchone()[0]
    return env


def run(entries: int, repeat: int) -> dict[str, Any]:
    import psycopg
    from psycopg import sql

    admin_url = postgres_admin_url()
    if not admin_url:
        raise SystemExit("bench/audit_log.py needs BENCH_POSTGRES_URL (a PostgreSQL server)")
    dbname = f"holdpoint_bench_audit_{os.getpid()}"
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    try:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="holdpoint-bench-audit-") as var_dir:
            # The test Client's host; DEBUG=1 only lets settings load without a SECRET_KEY.
            os.environ["ALLOWED_HOSTS"] = "testserver"
            os.environ["SECURE_SSL_REDIRECT"] = "0"
            setup_django(with_dbname(admin_url, dbname), var_dir)
            from django.conf import settings
            from django.db import connection, connections

            assert connection.settings_dict["NAME"] == dbname, "not the bench database"
            settings.DEBUG = False  # no debug cursor: production does not log every query
            try:
                started = time.perf_counter()
                log(f"[audit] {dbname}: migrating, writing {entries:,} entries…")
                setup = prepare(entries)
                log(
                    f"[audit] inserted in {setup['timings']['insert_s']:.1f}s, "
                    f"VACUUM ANALYZE {setup['timings']['vacuum_analyze_s']:.1f}s; "
                    f"big tenant {setup['data']['big_tenant_entries']:,} entries, "
                    f"baseline {setup['data']['baseline_tenant_entries']:,}"
                )
                results = measure(setup, repeat)
                return {
                    "benchmark": "the tenant audit log page (runtime.pages.audit.audit_log) on "
                    f"{entries:,} journal entries in PostgreSQL",
                    "method": "Django test Client GET of the real view (server time: middleware, "
                    "session, tenant, query, template; no network), as a reviewer of the "
                    f"largest tenant and, interleaved, of an almost empty one (baseline); "
                    f"{repeat} requests per case after 3 warm-ups; median, p90, min, max",
                    "threshold_ms": THRESHOLD_MS,
                    "all_under_threshold": all(r["under_threshold"] for r in results),
                    "data": setup["data"],
                    "cases": results,
                    "wall_seconds": time.perf_counter() - started,
                    "environment": {**environment(), "database": dbname},
                }
            finally:
                connections.close_all()
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname))
            )
        log(f"[audit] dropped database {dbname}")


def markdown(report: dict[str, Any]) -> str:
    env, data = report["environment"], report["data"]
    dirty = " + uncommitted changes" if env.get("git_changed_files") else ""
    verdict = "all under" if report["all_under_threshold"] else "NOT all under"
    lines = [
        f"# Audit log page: {data['entries']:,} journal entries in PostgreSQL",
        "",
        f"{env['date']} · git {env['git_head'] or '?'}{dirty} · PostgreSQL "
        f"{env['pg_server_version']} (shared_buffers {env['pg_shared_buffers']}, work_mem "
        f"{env['pg_work_mem']}) · Python {env['python']} · Django {env['django']} · "
        f"{env['cpu_count']} CPUs · {env['platform']}",
        "",
        f"Data: {data['entries']:,} entries over {data['span_days']} days in {data['tenants']} "
        f"tenants; the measured tenant has {data['big_tenant_entries']:,}, the baseline tenant "
        f"{data['baseline_tenant_entries']:,} (the next largest "
        f"{data['largest_other_tenant_entries']:,}). Table with indexes "
        f"{data['table_total_bytes'] / 2**20:,.0f} MiB. Insert {data['insert_s']:.1f} s, "
        f"VACUUM ANALYZE {data['vacuum_analyze_s']:.1f} s.",
        "",
        f"Server time of one page (Django test Client against the real view), median (p90, "
        f"min–max) of the requests; baseline = the same page for a reviewer of the almost "
        f"empty tenant, requests interleaved. Threshold {report['threshold_ms']:.0f} ms: "
        f"**{verdict}**.",
        "",
        "| page | ms | baseline ms | ratio | rows (baseline) | SQL stmts | main query: plan | "
        "EXPLAIN ANALYZE ms | buffers hit/read |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["cases"]:
        big, base, ex = r["big_ms"], r["baseline_ms"], r["explain"]
        plan = "; ".join(dict.fromkeys(ex["scans"])) + (
            f" + {ex['sort']} sort" if ex["sort"] else ""
        )
        lines.append(
            f"| {r['case']} | **{big['median']:.1f}** ({big['p90']:.1f}, {big['min']:.1f}–"
            f"{big['max']:.1f}) | {base['median']:.1f} | {r['ratio_of_medians']:.2f} "
            f"| {r['rows']} ({r['baseline_rows']}) | {r['big_queries']['statements']} | {plan} "
            f"| {fmt(ex['execution_ms'] or 0, 2)} | {ex['shared_hit']}/{ex['shared_read']} |"
        )
    lines += [
        "",
        "Query strings (big tenant): "
        + "; ".join(f"{r['case']}: `{json.dumps(r['params'])}`" for r in report["cases"]),
        "",
        f"Wall time {report['wall_seconds']:.0f} s. Plans in full: audit_log.json.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=1_000_000, help="default 1,000,000")
    parser.add_argument("--repeat", type=int, default=20, help="requests per case (default 20)")
    args = parser.parse_args()
    if args.entries < 10_000 or args.repeat < 1:
        parser.error("--entries must be >= 10000 (tenant 20 needs a few runs), --repeat >= 1")
    report = run(args.entries, args.repeat)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "audit_log.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (RESULTS / "audit_log.md").write_text(markdown(report))
    log(f"wrote {RESULTS / 'audit_log.json'} and {RESULTS / 'audit_log.md'}")
    print(markdown(report))
    return 0 if report["all_under_threshold"] else 1


if __name__ == "__main__":
    sys.exit(main())
