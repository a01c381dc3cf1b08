"""`make bench`: Holdpoint beside its peers and the hardware limit, in one run.

Per backend (SQLite always; PostgreSQL when BENCH_POSTGRES_URL or a PostgreSQL DATABASE_URL
names a server), in one child process on a scratch database:

1. durable step throughput of a 50-step no-op graph, one worker, in interleaved rounds with
   the raw limit (one-row BEGIN; INSERT; COMMIT, same driver, same durability settings),
   LangGraph's saver on the same backend (durability="sync") and DBOS Transact;
2. (bench/ledger.py) what the side-effect ledger adds to one HTTP side effect;
3. (bench/storage.py) bytes stored per run for a state growing 1 KB/step, 50 and 200 steps;
4. (bench/scaling.py) one worker process vs two, independent runs;
5. (bench/tracing.py) what OpenTelemetry tracing costs a step: off, on with the API's no-op
   provider, on with the SDK and an in-memory exporter;
6. (bench/recovery.py) SIGKILL of a real worker → the run's next committed step, and a
   storm of 2,000 runs with expired leases drained by the sweeper.

Then, PostgreSQL only, (bench/pages.py) the reviewer pages with 10,000 pending approvals
and 1,000,000 journal entries, against the same pages at 100 approvals.

    .venv/bin/python bench/run.py                      # SQLite (a fresh temporary file)
    BENCH_POSTGRES_URL=postgres://postgres@127.0.0.1:5432/postgres .venv/bin/python bench/run.py

The driver collects the children's JSON and writes bench/results/latest.json, latest.md and
the plots (bench/report.py). Nothing is written to the developer's database: SQLite runs in
a temporary directory; PostgreSQL in databases `holdpoint_bench_*` that the bench creates
and drops. Every process it starts it stops. See bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script
from bench.common import (  # noqa: E402
    RESULTS,
    ROOT,
    CpuMark,
    counters_pg,
    git_state,
    install_cleanup,
    log,
    peer_threads,
    postgres_admin_url,
    profile_call,
    scratch_postgres,
    setup_django,
    sqlalchemy_url,
    statement_kinds,
    stop_all,
    summary,
)
from bench.ledger import SANDBOX_MODE, LedgerBench, sandbox  # noqa: E402

PAYLOAD_BYTES = 100
PARTS = ("throughput", "ledger", "tracing", "storage", "scaling", "recovery", "storm", "pages")


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
_WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE")


def _writes(upper_sql: str) -> bool:
    """A statement that writes or locks rows (a CTE's data-modifying parts included)."""
    if upper_sql.startswith(_WRITES):
        return True
    if upper_sql.startswith("WITH"):
        return any(f" {verb} " in upper_sql or f"({verb} " in upper_sql for verb in _WRITES)
    return upper_sql.startswith("SELECT") and " FOR UPDATE" in upper_sql


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
        self.ledger: LedgerBench | None = None  # the side-effect benchmark, when a sandbox runs
        self.langgraph: Any = None  # bench.peers.LangGraphBench
        self.dbos: Any = None  # bench.peers.DbosBench
        self.dbos_dbname: str | None = None

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

    # PostgreSQL counters (xact_commit: one database; WAL: the whole server)
    def counters(self, dbname: str | None = None) -> dict[str, int]:
        if not self.server_counters:
            return {}
        with self.connection.cursor() as cur:
            return counters_pg(cur, dbname)

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
        cpu, t0 = CpuMark(), time.perf_counter()
        result = advance_run(run.run_id, "bench", slice_seconds=3600)
        t1, cpu_seconds = time.perf_counter(), cpu.seconds()
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
        return {"seconds": t1 - t0, "cpu": cpu_seconds, "delta": self.delta(before, after)}

    # B: raw INSERT + COMMIT on the same connection, same settings
    def raw_once(self) -> dict[str, Any]:
        from django.db import transaction

        self.round_no += 1
        rows = [
            f"{self.round_no:06d}-{i:06d}-".ljust(PAYLOAD_BYTES, "x") for i in range(self.steps)
        ]
        sql = "INSERT INTO bench_scratch (payload) VALUES (%s)"
        before = self.counters()
        cpu, t0 = CpuMark(), time.perf_counter()
        for payload in rows:
            # SQLite: BEGIN IMMEDIATE; INSERT; COMMIT.  PostgreSQL: BEGIN; INSERT; COMMIT.
            with transaction.atomic(durable=True), self.connection.cursor() as cur:
                cur.execute(sql, [payload])
        t1, cpu_seconds = time.perf_counter(), cpu.seconds()
        after = self.counters()
        return {"seconds": t1 - t0, "cpu": cpu_seconds, "delta": self.delta(before, after)}

    # C, D: the peers
    def peer_once(self, peer: Any, dbname: str | None = None) -> dict[str, Any]:
        before = self.counters(dbname)
        with peer_threads():  # its pools and pollers: not Holdpoint's CPU (CpuMark)
            result = peer.once()
        if self.pg and hasattr(peer, "flush_stats"):
            peer.flush_stats()  # its connection's pending statistics, before we read them
        after = self.counters(dbname)
        return {**result, "delta": self.delta(before, after)}

    def dbos_settled_txns(self, runs: int = 3) -> dict[str, float] | None:
        """DBOS's server transactions per step. Its pooled connections report statistics
        lazily (PostgreSQL flushes an idle backend's pending counts within 10 s), so counts
        are read after 10 s of quiet; its own database holds nothing else, but its
        background threads poll it, so the idle rate (a quiet window of the same kind) is
        subtracted. About 31 s, PostgreSQL only."""
        if not (self.pg and self.dbos):
            return None
        time.sleep(10.2)
        a, ta = self.counters(self.dbos_dbname)["xact"], time.monotonic()
        time.sleep(10.2)
        b, tb = self.counters(self.dbos_dbname)["xact"], time.monotonic()
        with peer_threads():
            for _ in range(runs):
                self.dbos.once()
        time.sleep(10.2)
        c, tc = self.counters(self.dbos_dbname)["xact"], time.monotonic()
        idle_rate = (b - a) / (tb - ta)
        return {
            "server_txns_per_step": (c - b - idle_rate * (tc - tb)) / (runs * self.steps),
            "idle_txns_per_second": idle_rate,
        }

    def statements(self, work: Callable[[], Any]) -> list[str]:
        """The SQL statements Django sends while `work` runs (BEGIN not counted; COMMIT is
        not an execute), with the server counters switched off."""
        return self.traced(work)[0]

    def traced(self, work: Callable[[], Any]) -> tuple[list[str], int]:
        """`statements`, and the durable commits among them: transactions that wrote (or
        locked) a row — an explicit commit after such a statement, or such a statement in
        autocommit. Counted on the client, from what Django sends and commits, so the same
        count on both databases (a read-only transaction costs no log flush: not counted)."""
        seen: list[str] = []
        dirty = [False]
        commits = [0]
        conn = self.connection

        def count(execute, sql, params, many, context):
            text = sql.lstrip().upper()
            if not text.startswith("BEGIN"):
                seen.append(sql)
            if _writes(text):
                if conn.in_atomic_block or not conn.get_autocommit():
                    dirty[0] = True
                else:
                    commits[0] += 1
            return execute(sql, params, many, context)

        plain_commit = conn._commit

        def commit() -> None:
            plain_commit()
            if dirty[0]:
                commits[0] += 1
                dirty[0] = False

        self.server_counters = False
        conn._commit = commit  # type: ignore[method-assign]
        try:
            with conn.execute_wrapper(count):
                work()
        finally:
            del conn._commit  # the class's method again
            self.server_counters = self.pg
        return seen, commits[0]

    def statements_per_step(self) -> dict[str, Any]:
        """SQL statements Django sends per step / per raw commit, from one extra run and one
        extra raw round."""
        from runtime.executor import advance_run
        from runtime.lifecycle import create_run

        run = create_run(self.tenant, "bench-noop", {"steps": self.steps}, actor="bench")
        seen, commits = self.traced(lambda: advance_run(run.run_id, "bench", slice_seconds=3600))
        raw, raw_commits = self.traced(self.raw_once)
        return {
            "holdpoint": len(seen) / self.steps,
            "raw": len(raw) / self.steps,
            "holdpoint_durable_commits": commits / self.steps,
            "raw_durable_commits": raw_commits / self.steps,
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
        with peer_threads():
            if self.langgraph:
                self.langgraph.once()
            if self.dbos:
                self.dbos.once()
        if self.ledger:
            self.ledger.warm_up()
        overhead = self.calibrate()
        per_round, ledger_rows = [], []
        for r in range(1, rounds + 1):
            a = self.holdpoint_once()
            b = self.raw_once()
            row: dict[str, Any] = {
                "round": r,
                "holdpoint_steps_per_s": n / a["seconds"],
                "raw_commits_per_s": n / b["seconds"],
                "holdpoint_cpu_ms_per_step": a["cpu"] * 1000 / n,
                "raw_cpu_ms_per_commit": b["cpu"] * 1000 / n,
                "holdpoint_seconds": a["seconds"],
                "raw_seconds": b["seconds"],
            }
            row["ratio"] = row["holdpoint_steps_per_s"] / row["raw_commits_per_s"]
            peers: dict[str, dict[str, Any]] = {}
            if self.langgraph:
                peers["langgraph"] = self.peer_once(self.langgraph)
            if self.dbos:
                peers["dbos"] = self.peer_once(self.dbos, self.dbos_dbname)
            for name, p in peers.items():
                row[f"{name}_steps_per_s"] = n / p["seconds"]
                row[f"{name}_cpu_ms_per_step"] = p["cpu"] * 1000 / n
                row[f"holdpoint_over_{name}"] = row["holdpoint_steps_per_s"] / (n / p["seconds"])
            if self.pg:
                row["holdpoint_per_step"] = self.per_step(a["delta"], overhead, n)
                row["raw_per_commit"] = self.per_step(b["delta"], overhead, n)
                row["holdpoint_counter_delta"] = a["delta"]
                row["raw_counter_delta"] = b["delta"]
                for name, p in peers.items():
                    # LangGraph: + the flush statement on its connection. DBOS: counted in
                    # its own database, which the counter reads do not touch.
                    own = (
                        {**overhead, "xact": overhead["xact"] + 1}
                        if name == "langgraph"
                        else {**overhead, "xact": 0}
                    )
                    row[f"{name}_per_step"] = self.per_step(p["delta"], own, n)
            per_round.append(row)
            peer_text = "".join(f", {name} {row[f'{name}_steps_per_s']:.0f}" for name in peers)
            log(
                f"[{self.backend}] round {r}/{rounds}: holdpoint {row['holdpoint_steps_per_s']:.0f}"
                f" steps/s, raw {row['raw_commits_per_s']:.0f} commits/s{peer_text},"
                f" ratio {row['ratio']:.3f}, cpu {row['holdpoint_cpu_ms_per_step']:.3f} ms/step"
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
            "per_round": per_round,
        }
        for key, value in per_round[0].items():
            if isinstance(value, float):
                out[key] = summary(col(key))
        if self.pg:
            out["counter_read_overhead"] = overhead
            for side in [
                k
                for k, v in per_round[0].items()
                if k.endswith(("_per_step", "_per_commit")) and isinstance(v, dict)
            ]:
                out[side] = {k: summary(col(side, k)) for k in per_round[0][side]}
        out["statements_per_step"] = self.statements_per_step()
        if self.pg and self.dbos:
            out["dbos_server_txns_per_step_settled"] = self.dbos_settled_txns()
        if profile:
            out["profile"] = self.profile()
        if self.ledger:
            out["ledger"] = self.ledger.results(ledger_rows, profile)
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
        if self.langgraph:
            env["langgraph_saver"] = self.langgraph.settings
        if self.dbos:
            env["dbos_launch_seconds"] = self.dbos.launch_seconds
        return env


def child(args: argparse.Namespace) -> None:
    install_cleanup()
    parts = set(args.parts.split(","))
    with tempfile.TemporaryDirectory(prefix="holdpoint-bench-") as var_dir:
        try:
            if args.backend == "sqlite":
                db_file = Path(var_dir) / "bench.sqlite3"
                url = f"sqlite:///{db_file}"
                setup_django(url, var_dir)
                from django.db import connection

                assert connection.settings_dict["NAME"] == str(db_file), "not the bench database"
                result = run_child(args, parts, url, var_dir)
                result["environment"]["database"] = str(db_file)
                result["environment"]["filesystem"] = filesystem_of(var_dir)
            else:
                with scratch_postgres("holdpoint_bench") as url:
                    setup_django(url, var_dir)
                    from django.db import connection, connections

                    assert connection.settings_dict["NAME"].startswith("holdpoint_bench_")
                    try:
                        result = run_child(args, parts, url, var_dir)
                        result["environment"]["database"] = connection.settings_dict["NAME"]
                    finally:
                        connections.close_all()
        finally:
            stop_all()
    Path(args.json_out).write_text(json.dumps(result, indent=2, default=str))


@contextlib.contextmanager
def peers(bench: Bench, url: str, var_dir: str, wanted: bool) -> Iterator[None]:
    """LangGraph's saver on the backend and DBOS on its own system database, when the bench
    extra is installed; closed (and the DBOS database dropped) on the way out."""
    from bench import peers as peer_mod

    found = peer_mod.available() if wanted else {}
    with contextlib.ExitStack() as stack:
        if "langgraph" in found:
            target = url if bench.pg else str(Path(var_dir) / "langgraph.sqlite3")
            with peer_threads():
                bench.langgraph = peer_mod.LangGraphBench(bench.backend, target, bench.steps)
            stack.callback(bench.langgraph.close)
        if "dbos" in found:
            if bench.pg:
                dbos_url = stack.enter_context(scratch_postgres("holdpoint_bench_dbos"))
                bench.dbos_dbname = dbos_url.rsplit("/", 1)[1]
                system_url = sqlalchemy_url(dbos_url)
            else:
                path = Path(var_dir) / "dbos.sqlite3"
                peer_mod.prepare_sqlite_wal(path)
                system_url = f"sqlite:///{path}"
            with peer_threads():  # DBOS's pollers run in this process from its launch on
                bench.dbos = peer_mod.DbosBench(system_url, bench.steps)
            stack.callback(bench.dbos.close)
        if wanted and not found:
            log("langgraph/dbos not installed: peers skipped (make bench installs the extra)")
        bench.peer_versions = found  # type: ignore[attr-defined]
        yield


def run_child(args: argparse.Namespace, parts: set[str], url: str, var_dir: str) -> dict[str, Any]:
    """Each part in turn; a part that fails (the engine under test raised, a worker died)
    is recorded under "errors" with its traceback's last line and the others still run."""
    from django.conf import settings

    bench = Bench(args.backend, args.steps)
    started = time.perf_counter()
    timings: dict[str, float] = {}
    bench.prepare()
    timings["migrate"] = time.perf_counter() - started
    log(f"[{args.backend}] migrated in {timings['migrate']:.1f}s")
    result: dict[str, Any] = {"backend": args.backend, "errors": {}}

    def part(name: str, work: Callable[[], Any]) -> None:
        if name not in parts:
            return
        t = time.perf_counter()
        try:
            result[name] = work()
        except Exception as exc:  # recorded, reported as a failure; the next part runs
            import traceback

            log(f"[{args.backend}] {name} FAILED:\n{traceback.format_exc()}")
            result["errors"][name] = f"{type(exc).__name__}: {exc}"[:2000]
        timings[name] = time.perf_counter() - t

    def throughput() -> dict[str, Any]:
        if "ledger" not in parts or not args.actions:
            return bench.go(args.rounds, args.profile)
        with sandbox(Path(settings.VAR_DIR)) as tasks_url:
            settings.HOLDPOINT_TASKS_URL, settings.HOLDPOINT_TASKS_DEDUP = tasks_url, SANDBOX_MODE
            bench.ledger = LedgerBench(bench, tasks_url, args.actions)
            try:
                return bench.go(args.rounds, args.profile)
            finally:
                bench.ledger = None

    def tracing() -> dict[str, Any]:
        from bench.tracing import TracingBench

        return TracingBench(bench).go(args.tracing_rounds)

    def storage() -> dict[str, Any]:
        from bench.storage import StorageBench

        return StorageBench(bench, bench.langgraph).go()

    def scaling() -> dict[str, Any]:
        from bench.scaling import ScalingBench

        # SQLite has one writer at a time: its pairs are information, so fewer of them.
        pairs = args.scaling_pairs if bench.pg else max(1, args.scaling_pairs // 2)
        return ScalingBench(bench, url, var_dir, runs=args.scaling_runs).go(pairs)

    from bench.recovery import RecoveryBench

    recovery = RecoveryBench(bench, url, var_dir)
    with peers(bench, url, var_dir, "throughput" in parts or "storage" in parts):
        part("throughput", throughput)
        part("tracing", tracing)
        part("storage", storage)
        result["environment"] = bench.environment()
        result["peer_versions"] = getattr(bench, "peer_versions", {})
    part("scaling", scaling)
    part("recovery", lambda: recovery.kill_samples(args.recovery_samples, args.as_deployed))
    part("storm", lambda: recovery.storm(args.storm_runs))
    result["timings"] = timings
    result["wall_seconds"] = time.perf_counter() - started
    return result


# --- driver ----------------------------------------------------------------------------------
def run_subprocess(cmd: list[str]) -> int:
    """A child in this process group (Ctrl-C reaches it too); waited for, killed if we are
    interrupted."""
    proc = subprocess.Popen(cmd, cwd=ROOT)
    try:
        return proc.wait()
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def driver(args: argparse.Namespace) -> int:
    from bench import report

    install_cleanup()
    began = time.perf_counter()
    pg = postgres_admin_url()
    backends = ["sqlite"] + (["postgres"] if pg else [])
    parts = args.parts.split(",")
    RESULTS.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    failed = []
    primary = backends[-1]  # PostgreSQL when there is one: the production shape
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
            "--parts",
            ",".join(p for p in parts if p != "pages"),
            "--tracing-rounds",
            str(args.tracing_rounds),
            "--scaling-pairs",
            str(args.scaling_pairs),
            "--scaling-runs",
            str(args.scaling_runs),
            "--recovery-samples",
            str(args.recovery_samples),
            "--storm-runs",
            str(args.storm_runs),
            "--json-out",
            str(out),
        ]
        if args.profile:
            cmd.append("--profile")
        if backend == primary and not args.no_as_deployed:
            cmd.append("--as-deployed")
        log(f"== {backend}: {' '.join(cmd[1:])}")
        t = time.perf_counter()
        code = run_subprocess(cmd)
        if code == 0 and out.stat().st_size:
            results[backend] = json.loads(out.read_text())
            failed += [f"{backend}: {name}" for name in results[backend].get("errors", {})]
        else:
            failed.append(backend)
            log(f"== {backend} failed (exit {code})")
        out.unlink(missing_ok=True)
        log(f"== {backend} done in {time.perf_counter() - t:.0f}s")
    pages = None
    if "pages" in parts:
        if pg:
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
                out = Path(tmp.name)
            cmd = [sys.executable, str(ROOT / "bench" / "pages.py"), "--json-out", str(out)]
            cmd += ["--approvals", str(args.approvals), "--entries", str(args.entries)]
            log(f"== pages: {' '.join(cmd[1:])}")
            t = time.perf_counter()
            code = run_subprocess(cmd)
            if code == 0 and out.stat().st_size:
                pages = json.loads(out.read_text())
            else:
                error = json.loads(out.read_text() or "{}").get("error", f"exit {code}")
                failed.append(f"pages: {error}")
            out.unlink(missing_ok=True)
            log(f"== pages done in {time.perf_counter() - t:.0f}s")
        else:
            log("== pages: PostgreSQL only (set BENCH_POSTGRES_URL); skipped")
    if args.audit_entries:
        failed += audit_log_step(args.audit_entries)
    environment = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
        **git_state(),
    }
    wall = time.perf_counter() - began
    doc = report.build(results, pages, environment, failed, wall, args)
    (RESULTS / "latest.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    text = report.markdown(doc)
    (RESULTS / "latest.md").write_text(text)
    report.charts(doc)
    log(f"wrote {RESULTS / 'latest.json'}, latest.md and the plots in {wall:.0f}s")
    print(text)
    return 1 if failed else 0


def audit_log_step(entries: int) -> list[str]:
    """bench/audit_log.py in its own process (its own scratch PostgreSQL database): the full
    matrix of audit-log filters; opt-in. Returns what failed."""
    if not postgres_admin_url():
        log("== audit log: needs BENCH_POSTGRES_URL (PostgreSQL); skipped")
        return ["audit_log"]
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "audit_log.py")]
    log(f"== audit log: {entries:,} entries")
    code = run_subprocess([*cmd, "--entries", str(entries)])
    return [] if code == 0 else ["audit_log"]


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
        "--parts",
        default=",".join(PARTS),
        help=f"comma-separated subset of {','.join(PARTS)} (default: all)",
    )
    parser.add_argument(
        "--tracing-rounds",
        type=int,
        default=30,
        help="interleaved rounds of the tracing part, one run per mode each (default 30)",
    )
    parser.add_argument("--scaling-pairs", type=int, default=6, help="1-vs-2-worker round pairs")
    parser.add_argument(
        "--scaling-runs",
        type=int,
        default=32,
        help="runs of 50 steps per scaling round (default 32: about 1.5 s for one worker)",
    )
    parser.add_argument("--recovery-samples", type=int, default=3, help="kills per backend")
    parser.add_argument("--storm-runs", type=int, default=2000, help="runs in the storm")
    parser.add_argument("--approvals", type=int, default=10_000, help="pending approvals (pages)")
    parser.add_argument("--entries", type=int, default=1_000_000, help="journal entries (pages)")
    parser.add_argument(
        "--no-as-deployed",
        action="store_true",
        help="skip the recovery sample that waits for django-q2's own scheduler (~40 s)",
    )
    parser.add_argument("--as-deployed", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also cProfile one extra run; writes results/profile-<backend>.txt",
    )
    parser.add_argument(
        "--audit-entries",
        type=int,
        default=0,
        help="also run bench/audit_log.py (every audit-log filter) with this many journal "
        "entries (PostgreSQL only; default 0 skips it)",
    )
    parser.add_argument("--json-out", help="child: where to write its JSON")
    parser.add_argument(
        "--report-only", action="store_true", help="rewrite latest.md and plots from latest.json"
    )
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 1 or args.actions < 0 or args.tracing_rounds < 1:
        parser.error("--rounds and --steps must be >= 1, --actions >= 0")
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}")
    if args.audit_entries and args.audit_entries < 10_000:
        parser.error("--audit-entries is 0 (skip) or >= 10000")
    if args.report_only:  # rewrite latest.md and the plots from latest.json
        from bench import report

        doc = json.loads((RESULTS / "latest.json").read_text())
        (RESULTS / "latest.md").write_text(report.markdown(doc))
        report.charts(doc)
        return 0
    if args.backend:
        if not args.json_out:
            parser.error("--backend needs --json-out")
        child(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
