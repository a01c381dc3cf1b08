"""Holdpoint's benchmarks, per backend, rounds interleaved in one process:

1. durable steps per second of a 50-step no-op graph, against the same database's raw
   INSERT+COMMIT rate;
2. (bench/ledger.py) what the side-effect ledger adds to one HTTP side effect: a 20-action
   `bench-act` run against the same requests sent bare to the sandbox task service, which
   each child starts as its own process (`--actions 0` skips it);
3. opt-in, `--audit-entries N` (PostgreSQL only): bench/audit_log.py, the tenant audit log
   page's server time on N journal entries, in its own process and scratch database.

    .venv/bin/python bench/run.py                      # SQLite (a fresh temporary file)
    BENCH_POSTGRES_URL=postgres://postgres@127.0.0.1:5432/postgres .venv/bin/python bench/run.py

Without --backend this is the driver: it runs itself once per backend in a subprocess (each
child has its own django.setup() and DATABASE_URL), collects their JSON and writes
bench/results/latest.json, latest.md and, when matplotlib is installed, latest.png.
It never touches the developer's database: SQLite runs in a temporary directory; PostgreSQL
runs in a database `holdpoint_bench_<pid>` that the child creates and drops on the server.
See bench/README.md for what is measured and how to read it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script
from bench import ledger
from bench.common import RESULTS, ROOT, fmt, log, profile_call, spread, statement_kinds, summary
from bench.ledger import SANDBOX_MODE, LedgerBench, sandbox

GRAPH_MODULES = "bench.graphs,runtime.agents.api_review.graph"
PAYLOAD_BYTES = 100


# --- helpers shared by driver and children ---------------------------------------------------
def postgres_admin_url() -> str | None:
    """The server to benchmark on: BENCH_POSTGRES_URL, else DATABASE_URL if it is PostgreSQL."""
    url = os.environ.get("BENCH_POSTGRES_URL", "").strip()
    if url:
        return url
    url = os.environ.get("DATABASE_URL", "").strip()
    if urlsplit(url).scheme in {"postgres", "postgresql", "pgsql"}:
        return url
    return None


def with_dbname(url: str, dbname: str) -> str:
    parts = urlsplit(url)
    scheme = "postgres" if parts.scheme == "pgsql" else parts.scheme
    return urlunsplit((scheme, parts.netloc, "/" + dbname, parts.query, parts.fragment))


def filesystem_of(path: str) -> str:
    """The filesystem type holding `path` (Linux /proc/mounts; "" elsewhere)."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return ""
    real = os.path.realpath(path)
    best = max(
        (m for m in mounts if real == m[0] or real.startswith(m[0].rstrip("/") + "/")),
        key=lambda m: len(m[0]),
        default=("", ""),
    )
    return best[1]


# --- child: one backend ----------------------------------------------------------------------
def setup_django(database_url: str, var_dir: str) -> None:
    os.environ["DJANGO_SETTINGS_MODULE"] = "config.settings"
    os.environ.setdefault("DEBUG", "1")
    os.environ.setdefault("LOG_LEVEL", "WARNING")  # no "Enqueued" line per create_run
    os.environ["DATABASE_URL"] = database_url
    os.environ["HOLDPOINT_VAR_DIR"] = var_dir
    modules = [m for m in os.environ.get("HOLDPOINT_GRAPH_MODULES", "").split(",") if m.strip()]
    for module in GRAPH_MODULES.split(","):
        if module not in modules:
            modules.append(module)
    os.environ["HOLDPOINT_GRAPH_MODULES"] = ",".join(modules)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import django

    django.setup()


class Bench:
    """Interleaved rounds on the database Django is configured for."""

    def __init__(self, backend: str, steps: int) -> None:
        from django.db import connection

        self.backend = backend
        self.steps = steps
        self.connection = connection
        self.pg = connection.vendor == "postgresql"
        self.round_no = 0
        self.server_counters = self.pg
        self.ledger: LedgerBench | None = None  # the second benchmark, when a sandbox runs

    # setup
    def prepare(self) -> None:
        from django.core.management import call_command

        from runtime.models import Tenant

        call_command("migrate", verbosity=0, interactive=False)
        self.tenant = Tenant.objects.create(slug="bench", name="Bench")
        with self.connection.cursor() as cur:
            if self.pg:
                cur.execute(
                    "CREATE TABLE bench_scratch (id bigserial PRIMARY KEY, payload text NOT NULL)"
                )
            else:
                cur.execute(
                    "CREATE TABLE bench_scratch "
                    "(id integer PRIMARY KEY AUTOINCREMENT, payload text NOT NULL)"
                )

    # PostgreSQL counters (xact_commit: this database; WAL: the whole server)
    def counters(self) -> dict[str, int]:
        if not self.server_counters:
            return {}
        with self.connection.cursor() as cur:
            cur.execute("SELECT pg_stat_force_next_flush()")
            cur.execute(
                "SELECT d.xact_commit, w.wal_sync, pg_current_wal_lsn()::text"
                " FROM pg_stat_database d, pg_stat_wal w WHERE d.datname = current_database()"
            )
            xact, wal_sync, lsn = cur.fetchone()
        high, low = lsn.split("/")
        return {
            "xact": int(xact),
            "wal_sync": int(wal_sync),
            "lsn": (int(high, 16) << 32) + int(low, 16),
        }

    @staticmethod
    def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
        return {k: after[k] - before[k] for k in before}

    def calibrate(self, times: int = 5) -> dict[str, float]:
        """What two back-to-back counter reads cost by themselves (subtracted below)."""
        if not self.pg:
            return {}
        deltas = [self.delta(self.counters(), self.counters()) for _ in range(times)]
        return {k: statistics.median(d[k] for d in deltas) for k in deltas[0]}

    def per_step(self, delta: dict[str, int], overhead: dict[str, float], n: int) -> dict:
        if not delta:
            return {}
        return {
            "server_txns": (delta["xact"] - overhead["xact"]) / n,
            "wal_fsyncs": (delta["wal_sync"] - overhead["wal_sync"]) / n,
            "wal_bytes": (delta["lsn"] - overhead["lsn"]) / n,
        }

    # A: Holdpoint
    def holdpoint_once(self) -> dict[str, Any]:
        from runtime.executor import advance_run
        from runtime.lifecycle import create_run
        from runtime.models import Checkpoint, RunStatus

        run = create_run(self.tenant, "bench-noop", {"steps": self.steps}, actor="bench")
        before = self.counters()
        cpu0, t0 = time.process_time(), time.perf_counter()
        result = advance_run(run.run_id, "bench", slice_seconds=3600)
        t1, cpu1 = time.perf_counter(), time.process_time()
        after = self.counters()
        run.refresh_from_db()
        ok = (
            result.outcome == "completed"
            and result.steps == self.steps
            and run.status == RunStatus.COMPLETED
            and run.checkpoint_rev == self.steps
            and Checkpoint.objects.filter(run_id=run.run_id).count() == self.steps
        )
        if not ok:
            raise RuntimeError(f"bench-noop run did not complete as expected: {result}")
        return {"seconds": t1 - t0, "cpu": cpu1 - cpu0, "delta": self.delta(before, after)}

    # B: raw INSERT + COMMIT on the same connection, same settings
    def raw_once(self) -> dict[str, Any]:
        from django.db import transaction

        self.round_no += 1
        rows = [
            f"{self.round_no:06d}-{i:06d}-".ljust(PAYLOAD_BYTES, "x") for i in range(self.steps)
        ]
        sql = "INSERT INTO bench_scratch (payload) VALUES (%s)"
        before = self.counters()
        cpu0, t0 = time.process_time(), time.perf_counter()
        for payload in rows:
            # SQLite: BEGIN IMMEDIATE; INSERT; COMMIT.  PostgreSQL: BEGIN; INSERT; COMMIT.
            with transaction.atomic(durable=True), self.connection.cursor() as cur:
                cur.execute(sql, [payload])
        t1, cpu1 = time.perf_counter(), time.process_time()
        after = self.counters()
        return {"seconds": t1 - t0, "cpu": cpu1 - cpu0, "delta": self.delta(before, after)}

    def statements(self, work: Callable[[], Any]) -> list[str]:
        """The SQL statements Django sends while `work` runs (BEGIN not counted; COMMIT is
        not an execute), with the server counters switched off."""
        seen: list[str] = []

        def count(execute, sql, params, many, context):
            if not sql.lstrip().upper().startswith("BEGIN"):
                seen.append(sql)
            return execute(sql, params, many, context)

        self.server_counters = False
        try:
            with self.connection.execute_wrapper(count):
                work()
        finally:
            self.server_counters = self.pg
        return seen

    def statements_per_step(self) -> dict[str, Any]:
        """SQL statements Django sends per step / per raw commit, from one extra run and one
        extra raw round."""
        from runtime.executor import advance_run
        from runtime.lifecycle import create_run

        run = create_run(self.tenant, "bench-noop", {"steps": self.steps}, actor="bench")
        seen = self.statements(lambda: advance_run(run.run_id, "bench", slice_seconds=3600))
        raw = self.statements(self.raw_once)
        return {
            "holdpoint": len(seen) / self.steps,
            "raw": len(raw) / self.steps,
            "holdpoint_run_statements": statement_kinds(seen),
        }

    def profile(self) -> dict[str, Any]:
        from runtime.executor import advance_run
        from runtime.lifecycle import create_run

        run = create_run(self.tenant, "bench-noop", {"steps": self.steps}, actor="bench")
        top = profile_call(
            lambda: advance_run(run.run_id, "bench", slice_seconds=3600), self.backend
        )
        return {"steps": self.steps, "top_cumulative": top}

    def go(self, rounds: int, profile: bool) -> dict[str, Any]:
        n = self.steps
        self.holdpoint_once()  # warm-up: imports, caches, connection, statement plans
        self.raw_once()
        if self.ledger:
            self.ledger.warm_up()
        overhead = self.calibrate()
        per_round, ledger_rows = [], []
        for r in range(1, rounds + 1):
            a = self.holdpoint_once()
            b = self.raw_once()
            row = {
                "round": r,
                "holdpoint_steps_per_s": n / a["seconds"],
                "raw_commits_per_s": n / b["seconds"],
                "holdpoint_cpu_ms_per_step": a["cpu"] * 1000 / n,
                "raw_cpu_ms_per_commit": b["cpu"] * 1000 / n,
                "holdpoint_seconds": a["seconds"],
                "raw_seconds": b["seconds"],
            }
            row["ratio"] = row["holdpoint_steps_per_s"] / row["raw_commits_per_s"]
            if self.pg:
                row["holdpoint_per_step"] = self.per_step(a["delta"], overhead, n)
                row["raw_per_commit"] = self.per_step(b["delta"], overhead, n)
                row["holdpoint_counter_delta"] = a["delta"]
                row["raw_counter_delta"] = b["delta"]
            per_round.append(row)
            log(
                f"[{self.backend}] round {r}/{rounds}: holdpoint {row['holdpoint_steps_per_s']:.0f}"
                f" steps/s, raw {row['raw_commits_per_s']:.0f} commits/s, ratio {row['ratio']:.3f},"
                f" cpu {row['holdpoint_cpu_ms_per_step']:.3f} ms/step"
            )
            if self.ledger:  # the same round goes on: act, bare (bench/ledger.py)
                noop_ms = a["seconds"] * 1000 / n
                ledger_rows.append(self.ledger.round(r, noop_ms, overhead))

        def col(key: str, sub: str | None = None) -> list[float]:
            return [r[key][sub] if sub else r[key] for r in per_round]

        out: dict[str, Any] = {
            "backend": self.backend,
            "steps_per_run": n,
            "rounds": rounds,
            "payload_bytes": PAYLOAD_BYTES,
            "holdpoint_steps_per_s": summary(col("holdpoint_steps_per_s")),
            "raw_commits_per_s": summary(col("raw_commits_per_s")),
            "ratio": summary(col("ratio")),
            "holdpoint_cpu_ms_per_step": summary(col("holdpoint_cpu_ms_per_step")),
            "raw_cpu_ms_per_commit": summary(col("raw_cpu_ms_per_commit")),
            "per_round": per_round,
        }
        if self.pg:
            out["counter_read_overhead"] = overhead
            for side in ("holdpoint_per_step", "raw_per_commit"):
                out[side] = {k: summary(col(side, k)) for k in per_round[0][side]}
        out["statements_per_step"] = self.statements_per_step()
        if profile:
            out["profile"] = self.profile()
        if self.ledger:
            out["ledger"] = self.ledger.results(ledger_rows, profile)
        out["environment"] = self.environment()
        return out

    def environment(self) -> dict[str, Any]:
        import sqlite3

        import django
        from django.conf import settings

        db = self.connection.settings_dict
        env: dict[str, Any] = {
            "django": django.get_version(),
            "sqlite3_sqlite_version": sqlite3.sqlite_version,
            "engine": db["ENGINE"],
            "debug_cursor": settings.DEBUG,
            "conn_max_age": db.get("CONN_MAX_AGE"),
        }
        with self.connection.cursor() as cur:
            if self.pg:
                import psycopg

                env["psycopg"] = psycopg.__version__
                for name in ("server_version", "fsync", "synchronous_commit", "wal_sync_method"):
                    cur.execute(f"SHOW {name}")
                    env[f"pg_{name}"] = cur.fetchone()[0]
            else:
                for pragma in ("journal_mode", "synchronous", "foreign_keys"):
                    cur.execute(f"PRAGMA {pragma}")
                    env[f"sqlite_{pragma}"] = cur.fetchone()[0]
                env["sqlite_transaction_mode"] = self.connection.transaction_mode
        return env


def child(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="holdpoint-bench-") as var_dir:
        if args.backend == "sqlite":
            db_file = Path(var_dir) / "bench.sqlite3"
            setup_django(f"sqlite:///{db_file}", var_dir)
            from django.db import connection

            assert connection.settings_dict["NAME"] == str(db_file), "not the bench database"
            result = run_child(args)
            result["environment"]["database"] = str(db_file)
            result["environment"]["filesystem"] = filesystem_of(var_dir)
        else:
            result = child_postgres(args, var_dir)
    Path(args.json_out).write_text(json.dumps(result, indent=2, default=str))


def child_postgres(args: argparse.Namespace, var_dir: str) -> dict[str, Any]:
    import psycopg
    from psycopg import sql

    admin_url = postgres_admin_url()
    if not admin_url:
        raise SystemExit("--backend postgres needs BENCH_POSTGRES_URL (or a postgres DATABASE_URL)")
    dbname = f"holdpoint_bench_{os.getpid()}"
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    try:
        setup_django(with_dbname(admin_url, dbname), var_dir)
        from django.db import connection, connections

        assert connection.settings_dict["NAME"] == dbname, "not the bench database"
        try:
            result = run_child(args)
            result["environment"]["database"] = dbname
            return result
        finally:
            connections.close_all()
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname))
            )
        log(f"[postgres] dropped database {dbname}")


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    from django.conf import settings

    # DEBUG=1 only lets the settings load without a SECRET_KEY; production runs without the
    # debug cursor, which records every query, so the measurement does too.
    settings.DEBUG = False
    bench = Bench(args.backend, args.steps)
    started = time.perf_counter()
    bench.prepare()
    log(f"[{args.backend}] migrated in {time.perf_counter() - started:.1f}s")
    if not args.actions:
        result = bench.go(args.rounds, args.profile)
    else:
        with sandbox(Path(settings.VAR_DIR)) as url:
            settings.HOLDPOINT_TASKS_URL, settings.HOLDPOINT_TASKS_DEDUP = url, SANDBOX_MODE
            bench.ledger = LedgerBench(bench, url, args.actions)
            result = bench.go(args.rounds, args.profile)
    result["wall_seconds"] = time.perf_counter() - started
    return result


# --- driver ----------------------------------------------------------------------------------
def git_state() -> dict[str, Any]:
    """The commit, and the files changed in the working tree (read-only git commands)."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout
        except OSError:
            return ""

    changed = [line[3:] for line in git("status", "--porcelain").splitlines() if line[3:]]
    return {
        "git_head": git("rev-parse", "--short", "HEAD").strip(),
        "git_changed_files": [f for f in changed if not f.startswith("bench/")],
    }


def driver(args: argparse.Namespace) -> int:
    backends = ["sqlite"] + (["postgres"] if postgres_admin_url() else [])
    RESULTS.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    failed = []
    for backend in backends:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
            out = Path(tmp.name)
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--backend",
            backend,
            "--rounds",
            str(args.rounds),
            "--steps",
            str(args.steps),
            "--actions",
            str(args.actions),
            "--json-out",
            str(out),
        ]
        if args.profile:
            cmd.append("--profile")
        log(f"== {backend}: {' '.join(cmd[1:])}")
        code = subprocess.run(cmd, cwd=ROOT).returncode
        if code == 0 and out.stat().st_size:
            results[backend] = json.loads(out.read_text())
        else:
            failed.append(backend)
            log(f"== {backend} failed (exit {code})")
        out.unlink(missing_ok=True)
    report = {
        "benchmark": "bench-noop: a no-op step repeated; durable steps/s vs raw INSERT+COMMIT/s",
        "method": "interleaved rounds (A: one Holdpoint run, B: the same number of raw commits); "
        "ratio = median of per-round holdpoint_steps_per_s / raw_commits_per_s",
        "side_effect_benchmark": ledger.BENCHMARK,
        "side_effect_method": ledger.METHOD,
        "environment": {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            **git_state(),
        },
        "backends": results,
        "failed": failed,
    }
    (RESULTS / "latest.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (RESULTS / "latest.md").write_text(markdown(report))
    chart(report)
    log(f"wrote {RESULTS / 'latest.json'} and {RESULTS / 'latest.md'}")
    print(markdown(report))
    if args.audit_entries:
        failed += audit_log_step(args.audit_entries)
    return 1 if failed else 0


def audit_log_step(entries: int) -> list[str]:
    """bench/audit_log.py in its own process (its own scratch PostgreSQL database): opt-in,
    since writing a million entries takes minutes. Returns what failed."""
    if not postgres_admin_url():
        log("== audit log: needs BENCH_POSTGRES_URL (PostgreSQL); skipped")
        return ["audit_log"]
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "audit_log.py")]
    log(f"== audit log: {entries:,} entries")
    code = subprocess.run([*cmd, "--entries", str(entries)], cwd=ROOT).returncode
    return [] if code == 0 else ["audit_log"]


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    dirty = " + uncommitted changes" if env.get("git_changed_files") else ""
    lines = [
        "# Benchmarks: 50-step no-op graph vs raw INSERT+COMMIT; side-effect overhead",
        "",
        f"{env['date']} · git {env['git_head'] or '?'}{dirty} · Python {env['python']} · "
        f"{env['cpu_count']} CPUs · {env['platform']}",
        "",
        "Median (min–max) over interleaved rounds. Ratio = median of per-round "
        "Holdpoint steps/s ÷ raw commits/s (1.0 would mean a step costs one bare commit).",
        "",
        "| backend | Holdpoint steps/s | raw commits/s | ratio | client CPU ms/step "
        "| raw CPU ms/commit | SQL statements/step |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, b in report["backends"].items():
        lines.append(
            f"| {name} | {spread(b['holdpoint_steps_per_s'])} | {spread(b['raw_commits_per_s'])} "
            f"| {spread(b['ratio'], 3)} | {spread(b['holdpoint_cpu_ms_per_step'], 3)} "
            f"| {spread(b['raw_cpu_ms_per_commit'], 3)} "
            f"| {b['statements_per_step']['holdpoint']:.2f} (raw "
            f"{b['statements_per_step']['raw']:.2f}) |"
        )
    pg = report["backends"].get("postgres")
    if pg:
        h, r = pg["holdpoint_per_step"], pg["raw_per_commit"]
        lines += [
            "",
            "PostgreSQL server counters (median per step; transactions from pg_stat_database of "
            "the bench database, WAL from pg_stat_wal / pg_current_wal_lsn, server-wide):",
            "",
            "| per durable step | server txns | WAL fsyncs | WAL bytes |",
            "| --- | --- | --- | --- |",
            f"| Holdpoint step | {h['server_txns']['median']:.2f} | {h['wal_fsyncs']['median']:.2f}"
            f" | {fmt(h['wal_bytes']['median'])} |",
            f"| raw INSERT+COMMIT | {r['server_txns']['median']:.2f} "
            f"| {r['wal_fsyncs']['median']:.2f} | {fmt(r['wal_bytes']['median'])} |",
        ]
    lines += [
        "",
        "SQL statements Django sent for one whole 50-step run (BEGIN/COMMIT not counted):",
        "",
    ]
    for name, b in report["backends"].items():
        kinds = b["statements_per_step"]["holdpoint_run_statements"]
        lines.append(f"- {name}: " + ", ".join(f"{k} ×{v}" for k, v in kinds.items()))
    lines += ledger.markdown_section(report)
    lines += ["", "Environment:", ""]
    for name, b in report["backends"].items():
        e = b["environment"]
        keys = ", ".join(f"{k}={v}" for k, v in e.items())
        lines.append(f"- {name}: {keys}; {b['rounds']} rounds in {b['wall_seconds']:.1f}s")
    if report["failed"]:
        lines.append(f"- FAILED: {', '.join(report['failed'])}")
    return "\n".join(lines) + "\n"


def chart(report: dict[str, Any]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        log("matplotlib not installed: no chart (make bench installs it)")
        return
    backends = report["backends"]
    if not backends:
        return
    with_ledger = any("ledger" in b for b in backends.values())
    rows = 2 if with_ledger else 1
    fig, axes = plt.subplots(
        rows, len(backends), figsize=(5 * len(backends), 3.5 * rows), squeeze=False
    )
    for ax, (name, b) in zip(axes[0], backends.items(), strict=True):
        rounds = [r["round"] for r in b["per_round"]]
        ax.plot(
            rounds,
            [r["raw_commits_per_s"] for r in b["per_round"]],
            "o-",
            label="raw INSERT+COMMIT /s",
        )
        ax.plot(
            rounds,
            [r["holdpoint_steps_per_s"] for r in b["per_round"]],
            "s-",
            label="Holdpoint steps /s",
        )
        ax.set_title(f"{name}: ratio {b['ratio']['median']:.3f}")
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(bottom=0)
        ax.legend(fontsize="small")
    if with_ledger:
        ledger.plot(axes[1], backends)
    fig.tight_layout()
    fig.savefig(RESULTS / "latest.png", dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--backend",
        choices=["sqlite", "postgres"],
        help="run one backend in this process (the driver passes it)",
    )
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (default 9)")
    parser.add_argument("--steps", type=int, default=50, help="steps per run (default 50)")
    parser.add_argument(
        "--actions",
        type=int,
        default=20,
        help="actions per bench-act run in the side-effect benchmark (default 20; 0 skips it)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also cProfile one extra run; writes results/profile-<backend>.txt",
    )
    parser.add_argument(
        "--audit-entries",
        type=int,
        default=0,
        help="also run bench/audit_log.py with this many journal entries (PostgreSQL only; "
        "default 0 skips it; 1000000 is the acceptance figure)",
    )
    parser.add_argument("--json-out", help="child: where to write its JSON")
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 1 or args.actions < 0:
        parser.error("--rounds and --steps must be >= 1, --actions >= 0")
    if args.audit_entries and args.audit_entries < 10_000:
        parser.error("--audit-entries is 0 (skip) or >= 10000")
    if args.backend:
        if not args.json_out:
            parser.error("--backend needs --json-out")
        child(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
