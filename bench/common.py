"""Helpers every benchmark module uses: summaries, scratch databases, Django set-up for a
scratch database, the state of the checkout measured, what a benchmark part needs of the run
it is part of (`BenchHost`), and child processes that are always stopped (finally blocks,
atexit and SIGTERM all end in `stop_all()`). It imports no other bench module, so every one of
them may import it."""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


class BenchHost(Protocol):
    """What a benchmark part (bench.ledger's LedgerBench) needs of the run it is part of —
    bench.run.Bench: its tenant and backend, and the PostgreSQL counters it reads around each
    measured piece of work. A protocol, so that the part need not import the runner that
    imports it."""

    backend: str
    pg: bool
    tenant: Any

    def counters(self, dbname: str | None = None) -> dict[str, int]: ...

    def delta(self, before: dict[str, int], after: dict[str, int]) -> dict[str, int]: ...

    def per_step(self, delta: dict[str, int], overhead: dict[str, float], n: int) -> dict: ...

    def traced(self, work: Callable[[], Any]) -> tuple[list[str], int]: ...

    def statements(self, work: Callable[[], Any]) -> list[str]: ...


def summary(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-p * len(ordered) // 100))))
    return ordered[rank - 1]


def fmt(value: float, digits: int = 0) -> str:
    return f"{value:,.{digits}f}"


def spread(s: dict[str, float], digits: int = 0) -> str:
    return f"{fmt(s['median'], digits)} ({fmt(s['min'], digits)}–{fmt(s['max'], digits)})"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def statement_kinds(statements: list[str]) -> dict[str, int]:
    """{"UPDATE runtime_run": 51, …}, most frequent first."""
    kinds: Counter[str] = Counter()
    for sql in statements:
        verb = sql.split(None, 1)[0].upper()
        table = re.search(r'(?:FROM|INTO|UPDATE)\s+"?(\w+)"?', sql, re.IGNORECASE)
        kinds[f"{verb} {table.group(1) if table else '?'}"] += 1
    return dict(kinds.most_common())


# --- CPU of the system under test ------------------------------------------------------------
# The peers run in this process (DBOS is a singleton with its own pollers and executors), and
# their background threads keep burning CPU while Holdpoint is measured: on a loaded machine
# `time.process_time()` put up to 1.5 ms of DBOS's polling on each Holdpoint action.
_peer_threads: set[int] = set()


@contextlib.contextmanager
def peer_threads() -> Iterator[None]:
    """Mark the threads a peer's code leaves running as the peer's, not Holdpoint's."""
    before = {t.native_id for t in threading.enumerate()}
    try:
        yield
    finally:
        _peer_threads.update(
            t.native_id
            for t in threading.enumerate()
            if t.native_id is not None and t.native_id not in before
        )


class CpuMark:
    """CPU used by this process since the mark, less what the peers' threads used meanwhile.
    A peer thread that ends between the mark and the reading cannot be read any more, so its
    time stays counted: the figure can only err towards more CPU for Holdpoint, never less.
    Threads Holdpoint itself starts are counted, as is everything outside a peer thread."""

    def __init__(self) -> None:
        self.process = time.process_time()
        self.peers = _peer_cpu()

    def seconds(self) -> float:
        now = _peer_cpu()
        peers = sum(now[i] - cpu for i, cpu in self.peers.items() if i in now)
        return time.process_time() - self.process - peers


def _thread_clock(tid: int) -> int:
    """Linux's CPU clock of one thread by its kernel id (MAKE_THREAD_CPUCLOCK(tid,
    CPUCLOCK_SCHED)): unlike pthread_getcpuclockid, asking after a thread that ended is an
    error (EINVAL), not undefined behaviour."""
    return (~tid << 3) | 6


def _peer_cpu() -> dict[int, float]:
    found = {}
    for tid in list(_peer_threads):
        try:
            found[tid] = time.clock_gettime(_thread_clock(tid))
        except OSError:  # ended: forgotten
            _peer_threads.discard(tid)
    return found


def profile_call(work: Callable[[], Any], name: str, top: int = 25) -> list[dict[str, Any]]:
    """cProfile `work`; write the top functions (cumulative, own time) to results/profile-
    <name>.txt and return the top `top` by cumulative time."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    work()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out).strip_dirs().sort_stats("cumulative")
    stats.print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    (RESULTS / f"profile-{name}.txt").write_text(out.getvalue())
    # The whole profile too, for a viewer (snakeviz, `python -m pstats`) or a by-module sum.
    stats.dump_stats(RESULTS / f"profile-{name}.pstats")
    entries = [
        {
            "function": f"{func[0]}:{func[1]}({func[2]})",
            "ncalls": ncalls,
            "tottime_ms": tottime * 1000,
            "cumtime_ms": cumtime * 1000,
        }
        for func, (_cc, ncalls, tottime, cumtime, _callers) in stats.stats.items()
    ]
    entries.sort(key=lambda e: e["cumtime_ms"], reverse=True)
    return entries[:top]


# --- databases -------------------------------------------------------------------------------
def postgres_admin_url() -> str | None:
    """The server to benchmark on: BENCH_POSTGRES_URL, else DATABASE_URL if it is PostgreSQL.
    Only used to create and drop scratch databases: nothing is ever written to its database."""
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


def sqlalchemy_url(url: str) -> str:
    """postgres://… → postgresql://… (DBOS and SQLAlchemy want the long scheme)."""
    parts = urlsplit(url)
    return urlunsplit(("postgresql", parts.netloc, parts.path, parts.query, parts.fragment))


@contextlib.contextmanager
def scratch_postgres(prefix: str) -> Iterator[str]:
    """Create `<prefix>_<pid>` on the bench server, yield its URL, drop it (WITH FORCE) on the
    way out whatever happened. The name always starts with holdpoint_bench_."""
    import psycopg
    from psycopg import sql

    admin_url = postgres_admin_url()
    if not admin_url:
        raise SystemExit("PostgreSQL parts need BENCH_POSTGRES_URL (or a postgres DATABASE_URL)")
    dbname = f"{prefix}_{os.getpid()}"
    assert dbname.startswith("holdpoint_bench_"), dbname
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname))
        )
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    try:
        yield with_dbname(admin_url, dbname)
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname))
            )
        log(f"[postgres] dropped database {dbname}")


GRAPH_MODULES = "bench.graphs,runtime.agents.api_review.graph"


PASSED_ON = frozenset({"HOLDPOINT_OVERLAP_COMMITS"})


def bench_env(database_url: str, var_dir: str, **extra: str) -> dict[str, str]:
    """The environment of every process the bench starts against a scratch database: the
    bench graphs, the ORM broker in that database (never a shared Redis: another cluster
    would take our tasks), and the scratch database — never the developer's. DEBUG=1 only
    lets the settings load without production secrets; every bench process switches
    `settings.DEBUG` off right after `django.setup()` (bench/djrun.py for manage.py
    commands), so no process runs with the debug cursor that records every query.
    HOLDPOINT_OVERLAP_COMMITS is passed on (the one setting an A/B of the bench's worker
    processes needs: `HOLDPOINT_OVERLAP_COMMITS=0 make bench`)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if (not k.startswith(("HOLDPOINT_", "DJANGO_")) or k in PASSED_ON)
        and k not in {"REDIS_URL", "DEBUG"}
    }
    env.update(
        DJANGO_SETTINGS_MODULE="config.settings",
        DEBUG="1",
        ALLOWED_HOSTS="testserver,127.0.0.1,localhost",
        SECURE_SSL_REDIRECT="0",
        LOG_LEVEL="WARNING",
        DATABASE_URL=database_url,
        HOLDPOINT_VAR_DIR=var_dir,
        HOLDPOINT_GRAPH_MODULES=GRAPH_MODULES,
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(ROOT),
    )
    env.update(extra)
    return env


def setup_django(database_url: str, var_dir: str, **extra: str) -> None:
    """django.setup() in this process on a scratch database, with `bench_env` settings."""
    os.environ.update(bench_env(database_url, var_dir, **extra))
    for key in ("REDIS_URL",):
        os.environ.pop(key, None)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.conf import settings

    settings.DEBUG = False  # no debug cursor: production does not log every query


def counters_pg(cursor: Any, dbname: str | None = None) -> dict[str, int]:
    """xact_commit of a database (default: the current one; per database) and the server's
    WAL fsyncs and position (server-wide)."""
    cursor.execute("SELECT pg_stat_force_next_flush()")
    cursor.execute(
        "SELECT d.xact_commit, w.wal_sync, pg_current_wal_lsn()::text"
        " FROM pg_stat_database d, pg_stat_wal w"
        " WHERE d.datname = coalesce(%s, current_database())",
        [dbname],
    )
    xact, wal_sync, lsn = cursor.fetchone()
    high, low = lsn.split("/")
    return {
        "xact": int(xact),
        "wal_sync": int(wal_sync),
        "lsn": (int(high, 16) << 32) + int(low, 16),
    }


# --- child processes -------------------------------------------------------------------------
_children: list[subprocess.Popen[Any]] = []


def start_process(
    args: list[str], env: dict[str, str], log_path: Path | None = None, **kw: Any
) -> subprocess.Popen[Any]:
    """Start `args` in its own session (so a SIGKILL of its group reaches its children and
    nothing else), remembered so that `stop_all` ends it if the caller cannot."""
    out: Any = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    try:
        proc = subprocess.Popen(
            args,
            cwd=ROOT,
            env=env,
            stdout=kw.pop("stdout", out),
            stderr=kw.pop("stderr", subprocess.STDOUT if log_path else subprocess.DEVNULL),
            start_new_session=True,
            **kw,
        )
    finally:
        if log_path:
            out.close()
    _children.append(proc)
    return proc


def kill_group(proc: subprocess.Popen[Any], sig: int = signal.SIGKILL) -> None:
    """Signal the process's whole group (a qcluster's workers too) and reap the leader."""
    if proc.poll() is None or sig == signal.SIGKILL:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    if proc in _children:
        _children.remove(proc)


def stop_all() -> None:
    """End every child this process started and did not stop yet (their whole groups)."""
    while _children:
        proc = _children.pop()
        with contextlib.suppress(Exception):
            kill_group(proc)


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks: drops, kills


def install_cleanup() -> None:
    """Children are stopped at exit and on SIGTERM/SIGHUP (Ctrl-C raises KeyboardInterrupt,
    which unwinds the same finally blocks)."""
    atexit.register(stop_all)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_sigterm)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(
    check: Callable[[], Any],
    timeout: float,
    every: float = 0.05,
    what: str = "condition not met",
) -> Any:
    """Poll `check` until it returns something truthy; TimeoutError("<what> within Ns")."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout:.0f}s")
        time.sleep(every)


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
