"""Reviewer pages at scale (PostgreSQL): the inbox, a request page and a filtered audit-log
page, with 10,000 pending approvals across 20 tenants and 1,000,000 journal entries —
against the same pages with 100 pending approvals and 10,000 entries.

Each size is built in its own scratch database `holdpoint_bench_pages_<size>_<pid>`
(created, migrated, dropped at the end), by its own process (`--phase small|big`):

1. the journal, written in one INSERT … SELECT generate_series (bench/audit_log.py
   `prepare`: 20 tenants, the first holding a quarter of all entries, 180 days), VACUUM
   ANALYZE'd as autovacuum would have;
2. a reviewer per tenant in the tenant's reviewer group, an approval policy on
   tasks.create granted to that group;
3. 5 pending approvals per tenant through the engine's real path: a `bench-hold` run
   (bench/graphs.py) advanced to its hold point — prepare, the policy's hold, the request,
   its journal entries;
4. big size only: those rows cloned in SQL (runs, actions, requests; new ids, later
   expiries) up to `--approvals` pending requests, plus as many decided ones (approved or
   rejected by the tenant's reviewer: the history "similar decisions" reads), then VACUUM
   ANALYZE.

Measured as tenant 1's reviewer through Django's test Client (the whole request path:
middleware, session, tenant, queries, template; no network; DEBUG and its debug cursor
off): GET /inbox/, GET /approvals/<a pending request made through the real path>/ and
GET /audit/?type=approval_decided (plus /audit/?actor=… as a second filter). 5 warm-ups,
then `--repeat` requests per page, pages interleaved; p50 and p95 of the server time. SQL
statements per request from one extra request (each timed around the driver call), with
the slowest statements; at the big size EXPLAIN (ANALYZE, BUFFERS) of the slowest SELECTs
and a cProfile of one request.

    BENCH_POSTGRES_URL=postgres://postgres@127.0.0.1:5432/postgres .venv/bin/python bench/pages.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script
from bench.common import (  # noqa: E402
    ROOT,
    install_cleanup,
    log,
    percentile,
    postgres_admin_url,
    scratch_postgres,
    setup_django,
)

TENANTS = 20
REAL_PER_TENANT = 5
THRESHOLD_MS = 100.0
WARMUP = 5


# --- building the data -----------------------------------------------------------------------
def reviewers_and_policies(tenants: list[Any], users: dict[int, Any]) -> dict[int, Any]:
    """A reviewer per tenant (the journal's prepare made those of tenants 1 and 20) in the
    tenant's reviewer group, and a tasks.create policy granted to that group."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group

    from approvals.models import ApprovalPolicy
    from approvals.policies import grant
    from runtime.models import Membership, Role

    reviewers = {}
    for n, tenant in enumerate(tenants, 1):
        user = users.get(n)
        if user is None:
            user = get_user_model().objects.create_user(username=f"reviewer-{n:02d}")
            Membership.objects.create(tenant=tenant, user=user, role=Role.REVIEWER)
        group, _ = Group.objects.get_or_create(name=f"{tenant.slug}-reviewers")
        user.groups.add(group)
        policy = ApprovalPolicy.objects.create(
            tenant=tenant, name="tasks need review", tool="tasks.create"
        )
        grant(policy, group)
        reviewers[n] = user
    return reviewers


def real_requests(tenants: list[Any], per_tenant: int) -> list[Any]:
    """Pending requests made by the engine: bench-hold runs advanced to their hold point."""
    from django.conf import settings

    from approvals.models import ApprovalRequest, ApprovalStatus
    from runtime.executor import advance_run
    from runtime.lifecycle import create_run

    # The built-in tracker tools exist only where HOLDPOINT_TASKS_URL names a tracker. Every
    # bench-hold action waits at its hold point, so nothing is ever sent there (a closed port).
    settings.HOLDPOINT_TASKS_URL = settings.HOLDPOINT_TASKS_URL or "http://127.0.0.1:9"
    made = []
    for n, tenant in enumerate(tenants, 1):
        for k in range(per_tenant):
            run = create_run(
                tenant,
                "bench-hold",
                {"title": f"Review change {k + 1} of tenant {n}", "target": f"service-{k % 3}"},
                actor=f"agent:t{n:02d}-agent",
            )
            result = advance_run(run.run_id, "bench-pages", slice_seconds=3600)
            if result.outcome != "waiting":
                raise RuntimeError(f"bench-hold run did not park at its hold point: {result}")
            made.append(
                ApprovalRequest.objects.get(run_id=run.run_id, status=ApprovalStatus.PENDING)
            )
    return made


def _columns(model: Any) -> list[str]:
    return [f.column for f in model._meta.concrete_fields]


def clone_sql(model: Any, alias: str, overrides: dict[str, str]) -> tuple[str, str]:
    """(column list, select list) copying `model`'s rows with some columns replaced."""
    cols = _columns(model)
    unknown = set(overrides) - set(cols)
    assert not unknown, f"{model.__name__} has no columns {unknown}"
    return (
        ", ".join(f'"{c}"' for c in cols),
        ", ".join(overrides.get(c, f'{alias}."{c}"') for c in cols),
    )


def clone_requests(copies: int, decided: bool, reviewers: dict[int, Any]) -> int:
    """Copy every pending request made through the real path `copies` times, with its run
    and action (new ids derived from the originals', later expiries); `decided`: the copies
    are approved/rejected history instead. One INSERT … SELECT per table."""
    from django.db import connection

    from approvals.models import ApprovalRequest
    from runtime.models import Action, Run

    tag = "d" if decided else "p"
    new = f"md5(%s::text || ':{tag}' || g)::uuid"
    run_cols, run_select = clone_sql(
        Run,
        "r",
        {
            "run_id": new % "r.run_id",
            "thread_id": f"md5(r.thread_id || ':{tag}' || g)",
            "status": "'completed'" if decided else 'r."status"',
            "created_at": "r.created_at - g * interval '7 minutes'",
            "updated_at": "r.updated_at - g * interval '7 minutes'",
        },
    )
    action_cols, action_select = clone_sql(
        Action,
        "a",
        {
            "action_id": new % "a.action_id",
            "run_id": new % "a.run_id",
            "idempotency_key": f"a.idempotency_key || ':{tag}' || g",
            "status": "'cancelled'" if decided else 'a."status"',
            "created_at": "a.created_at - g * interval '7 minutes'",
            "updated_at": "a.updated_at - g * interval '7 minutes'",
        },
    )
    # (mod(), not %: these go through the driver's %s parameter substitution)
    decision = "CASE WHEN mod(g, 5) = 0 THEN 'reject' ELSE 'approve' END"
    request_overrides = {
        "id": new % "q.id",
        "run_id": new % "q.run_id",
        "action_id": new % "q.action_id",
        "title": "q.title || ' #' || g",
        "expires_at": "q.expires_at + g * interval '3 minutes'",
        "created_at": "q.created_at - g * interval '7 minutes'",
        "updated_at": "q.updated_at - g * interval '7 minutes'",
        "previous_id": "NULL",
    }
    if decided:
        request_overrides.update(
            status="CASE WHEN mod(g, 5) = 0 THEN 'rejected' ELSE 'approved' END",
            decision=decision,
            decided_by_id="rv.user_id",
            decided_at="now() - g * interval '11 minutes'",
            decision_reason="CASE WHEN mod(g, 5) = 0 THEN 'Wrong target' ELSE 'looks right' END",
            expires_at="q.expires_at - g * interval '3 minutes'",
        )
    request_cols, request_select = clone_sql(ApprovalRequest, "q", request_overrides)
    templates = (
        "SELECT id, run_id, action_id, tenant_id FROM approvals_approvalrequest"
        " WHERE status = 'pending' AND title NOT LIKE '%%#%%'"  # the real-path ones
    )
    reviewer_rows = ", ".join(
        f"({user.memberships.get().tenant_id}, {user.pk})" for user in reviewers.values()
    )
    with connection.cursor() as cur:
        cur.execute(
            f"INSERT INTO runtime_run ({run_cols}) SELECT {run_select} FROM runtime_run r"
            f" JOIN ({templates}) t ON t.run_id = r.run_id"
            " CROSS JOIN generate_series(1, %s) g",
            [copies],
        )
        cur.execute(
            f"INSERT INTO runtime_action ({action_cols}) SELECT {action_select}"
            f" FROM runtime_action a JOIN ({templates}) t ON t.action_id = a.action_id"
            " CROSS JOIN generate_series(1, %s) g",
            [copies],
        )
        cur.execute(
            f"INSERT INTO approvals_approvalrequest ({request_cols}) SELECT {request_select}"
            f" FROM approvals_approvalrequest q JOIN ({templates}) t ON t.id = q.id"
            f" JOIN (VALUES {reviewer_rows}) rv(tenant_id, user_id) ON rv.tenant_id = q.tenant_id"
            " CROSS JOIN generate_series(1, %s) g",
            [copies],
        )
        return cur.rowcount


def build(phase: str, approvals: int, entries: int) -> dict[str, Any]:
    from django.db import connection

    from approvals.models import ApprovalRequest
    from bench import audit_log

    started = time.perf_counter()
    setup = audit_log.prepare(entries)  # migrate, 20 tenants, the journal, VACUUM ANALYZE
    timings = dict(setup["timings"])
    tenants = setup["tenants"]
    reviewers = reviewers_and_policies(tenants, setup["users"])
    t = time.perf_counter()
    per_tenant = max(1, approvals // TENANTS)
    real_per_tenant = min(REAL_PER_TENANT, per_tenant)
    real = real_requests(tenants, real_per_tenant)
    timings["real_requests_s"] = time.perf_counter() - t
    copies = per_tenant // real_per_tenant - 1  # 0 at the small size
    t = time.perf_counter()
    if copies:
        clone_requests(copies, decided=False, reviewers=reviewers)
    decided = clone_requests(max(1, copies + 1), decided=True, reviewers=reviewers)
    with connection.cursor() as cur:
        for table in ("runtime_run", "runtime_action", "approvals_approvalrequest"):
            cur.execute(f"VACUUM (ANALYZE) {table}")
    timings["clone_s"] = time.perf_counter() - t
    pending = ApprovalRequest.objects.filter(status="pending")
    data = {
        "phase": phase,
        "journal_entries": entries,
        "tenants": TENANTS,
        "pending_approvals": pending.count(),
        "pending_in_measured_tenant": pending.filter(tenant=tenants[0]).count(),
        "decided_approvals": decided,
        "real_path_requests": len(real),
        "journal_entries_in_measured_tenant": setup["data"]["big_tenant_entries"],
        "journal_table_bytes": setup["data"]["table_total_bytes"],
        "build_seconds": time.perf_counter() - started,
        **timings,
    }
    mine = [r for r in real if r.tenant_id == tenants[0].pk]
    return {"data": data, "user": reviewers[1], "request": mine[0], "setup": setup}


# --- measuring -------------------------------------------------------------------------------
def statements_of(client: Any, url: str) -> list[dict[str, Any]]:
    """The SQL statements one request sends, each timed around the driver call, with its
    parameters filled in (so that it can be EXPLAINed)."""
    from django.db import connection

    seen: list[dict[str, Any]] = []

    def timed(execute: Any, sql: str, params: Any, many: bool, context: dict[str, Any]) -> Any:
        began = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            ms = (time.perf_counter() - began) * 1000
            try:
                # None for a statement sent by a cursor of our own (fastsql's): its SQL then
                text = connection.ops.last_executed_query(context["cursor"], sql, params) or sql
            except Exception:
                text = sql
            seen.append({"sql": text, "ms": ms})

    with connection.execute_wrapper(timed):
        response = client.get(url)
    assert response.status_code == 200, (url, response.status_code)
    return seen


def explain(sql: str) -> dict[str, Any]:
    import re

    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql)
        plan = "\n".join(row[0] for row in cur.fetchall())
    executed = re.search(r"Execution Time: ([\d.]+) ms", plan)
    scans = re.findall(
        r"((?:Parallel )?(?:Index Only Scan|Index Scan|Seq Scan|Bitmap Heap Scan|Bitmap Index Scan)"
        r"(?: Backward)?(?: using \w+)?(?: on \w+)?)",
        plan,
    )
    return {
        "execution_ms": float(executed.group(1)) if executed else None,
        "scans": list(dict.fromkeys(scans)),
        "plan": plan,
    }


def profile_request(client: Any, url: str, top: int = 40) -> list[dict[str, Any]]:
    """cProfile one request: where the server time goes (functions by cumulative time)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    client.get(url)
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = [
        {
            "function": f"{Path(func[0]).name}:{func[1]}({func[2]})",
            "path": func[0].replace(str(ROOT) + "/", ""),
            "calls": ncalls,
            "cumulative_ms": cumtime * 1000,
            "own_ms": tottime * 1000,
        }
        for func, (_cc, ncalls, tottime, cumtime, _callers) in stats.stats.items()  # type: ignore[attr-defined]
    ]
    rows.sort(key=lambda r: r["cumulative_ms"], reverse=True)
    return rows[:top]


def measure(built: dict[str, Any], repeat: int, explain_slowest: int) -> dict[str, Any]:
    from django.test import Client
    from django.urls import reverse

    client = Client()
    client.force_login(built["user"])
    pages = {
        "inbox": reverse("inbox"),
        "request": reverse("approval-page", args=[built["request"].pk]),
        "audit": reverse("audit-log") + "?type=approval_decided",
        "audit_actor": reverse("audit-log") + "?actor=user:t01-rev2",
    }
    for url in pages.values():
        for _ in range(WARMUP):
            assert client.get(url).status_code == 200, url
    samples: dict[str, list[float]] = {name: [] for name in pages}
    sizes: dict[str, int] = {}
    for _ in range(repeat):
        for name, url in pages.items():  # interleaved: A B C D A B C D …
            began = time.perf_counter()
            response = client.get(url)
            samples[name].append((time.perf_counter() - began) * 1000)
            sizes[name] = len(response.content)
    out: dict[str, Any] = {}
    for name, url in pages.items():
        statements = statements_of(client, url)
        slowest = sorted(statements, key=lambda s: s["ms"], reverse=True)[:5]
        row = {
            "url": url,
            "p50_ms": statistics.median(samples[name]),
            "p95_ms": percentile(samples[name], 95),
            "min_ms": min(samples[name]),
            "max_ms": max(samples[name]),
            "samples": len(samples[name]),
            "sql_statements": len(statements),
            "sql_ms_total": sum(s["ms"] for s in statements),
            "response_bytes": sizes[name],
            "slowest_statements": [{"ms": s["ms"], "sql": s["sql"][:2000]} for s in slowest],
            "statements": [{"ms": s["ms"], "sql": s["sql"][:200]} for s in statements],
        }
        if explain_slowest:  # the big size: plans of the slowest SELECTs, and a profile
            row["profile"] = profile_request(client, url)
            selects = [
                s for s in slowest if s["sql"].lstrip().upper().startswith(("SELECT", "WITH"))
            ]
            row["explain"] = [
                {"sql": s["sql"][:2000], **explain(s["sql"])} for s in selects[:explain_slowest]
            ]
        out[name] = row
        log(
            f"  {name}: p50 {row['p50_ms']:.1f} ms, p95 {row['p95_ms']:.1f} ms, "
            f"{row['sql_statements']} SQL statements ({row['sql_ms_total']:.1f} ms in SQL)"
        )
    return out


def phase(args: argparse.Namespace) -> None:
    install_cleanup()
    with (
        tempfile.TemporaryDirectory(prefix="holdpoint-bench-pages-") as var_dir,
        scratch_postgres(f"holdpoint_bench_pages_{args.phase}") as url,
    ):
        setup_django(url, var_dir)
        from django.db import connection, connections

        assert connection.settings_dict["NAME"].startswith("holdpoint_bench_pages_")
        try:
            log(f"[pages {args.phase}] {args.approvals:,} approvals, {args.entries:,} entries…")
            built = build(args.phase, args.approvals, args.entries)
            log(
                f"[pages {args.phase}] built in {built['data']['build_seconds']:.0f}s: "
                f"{built['data']['pending_approvals']:,} pending, "
                f"{built['data']['decided_approvals']:,} decided"
            )
            pages = measure(built, args.repeat, 2 if args.phase == "big" else 0)
            with connection.cursor() as cur:
                cur.execute("SHOW server_version")
                version = cur.fetchone()[0]
        finally:
            connections.close_all()
    Path(args.json_out).write_text(
        json.dumps(
            {"data": built["data"], "pages": pages, "pg_server_version": version}, default=str
        )
    )


def run_phase(name: str, approvals: int, entries: int, repeat: int) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        out = Path(tmp.name)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--phase", name, "--json-out", str(out)]
    cmd += ["--approvals", str(approvals), "--entries", str(entries), "--repeat", str(repeat)]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    try:
        code = proc.wait()
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
    try:
        if code != 0:
            error = json.loads(out.read_text() or "{}").get("error", f"exit {code}")
            raise PhaseFailed(f"phase {name}: {error}")
        return json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)


class PhaseFailed(Exception):
    pass


def driver(args: argparse.Namespace) -> dict[str, Any]:
    small = run_phase("small", 100, 10_000, args.repeat)
    big = run_phase("big", args.approvals, args.entries, args.repeat)
    pages = {}
    for name in big["pages"]:
        b, s = big["pages"][name], small["pages"][name]
        grew = []
        if b["sql_statements"] == s["sql_statements"]:  # same statements in the same order
            grew = sorted(
                (
                    {"sql": x["sql"], "small_ms": y["ms"], "big_ms": x["ms"]}
                    for x, y in zip(b["statements"], s["statements"], strict=True)
                ),
                key=lambda g: g["big_ms"] - g["small_ms"],
                reverse=True,
            )[:3]
        pages[name] = {
            "statements_grew_most": grew,
            "server_ms_outside_sql_p50": b["p50_ms"] - b["sql_ms_total"],
            "p50_ms": b["p50_ms"],
            "p95_ms": b["p95_ms"],
            "small_p50_ms": s["p50_ms"],
            "small_p95_ms": s["p95_ms"],
            "sql_statements": b["sql_statements"],
            "small_sql_statements": s["sql_statements"],
            "statements_constant": b["sql_statements"] == s["sql_statements"],
            "p95_under_threshold": b["p95_ms"] < THRESHOLD_MS,
        }
    return {
        "threshold_ms": THRESHOLD_MS,
        "repeat": args.repeat,
        "pages": pages,
        "small": small,
        "big": big,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase", choices=["small", "big"], help=argparse.SUPPRESS)
    parser.add_argument("--approvals", type=int, default=10_000)
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=40, help="requests per page (default 40)")
    parser.add_argument("--json-out", required=True)
    args = parser.parse_args()
    if args.entries < 10_000 or args.approvals < TENANTS:
        parser.error("--entries >= 10000, --approvals >= 20")
    if not postgres_admin_url():
        parser.error("needs BENCH_POSTGRES_URL (or a PostgreSQL DATABASE_URL)")
    if args.phase:
        try:
            phase(args)
        except Exception as exc:  # the engine under test raised: say what, for the report
            import traceback

            traceback.print_exc()
            Path(args.json_out).write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
            return 1
        return 0
    install_cleanup()
    try:
        Path(args.json_out).write_text(json.dumps(driver(args), indent=2, default=str))
    except PhaseFailed as exc:
        log(f"pages: {exc}")
        Path(args.json_out).write_text(json.dumps({"error": str(exc)[:2000]}))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
