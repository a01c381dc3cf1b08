"""Holdpoint's second benchmark: what the side-effect ledger adds to one HTTP side effect.

Runs inside bench/run.py's per-backend child, in the same interleaved rounds as the no-op
benchmark (noop, raw, act, bare — every round), against the sandbox task service started as
its own process on a free port (mode `key`, its own SQLite file in the child's temp dir):

- act:  a `bench-act` run of N steps, each `ctx.act("tasks.create", {"title": …})` →
        ms per action, step commit included;
- bare: the same N request bodies (the canonical JSON bytes the ledger stores and sends),
        each through the connection pool http tools use (`runtime.wire.origin()`) —
        and the headers the tool sends (Idempotency-Key, Content-Type, Holdpoint-Fence/-Run) →
        ms per call;
- the no-op step of the same round → ms per bare durable step.

After every round the sandbox must hold exactly one task per request sent so far, and the
act run's tasks must be exactly its confirmed actions (keys and ids); anything else fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from bench.common import (
    ROOT,
    BenchHost,
    CpuMark,
    fmt,
    free_port,
    log,
    profile_call,
    spread,
    statement_kinds,
    summary,
)

SANDBOX_MODE = "key"
BENCHMARK = (
    "bench-act: one tasks.create per step through ctx.act (prepare, sent, HTTP call, outcome) "
    "vs the same HTTP request sent bare to the sandbox task service"
)
METHOD = (
    "same interleaved rounds as bench-noop (noop, raw, act, bare); per round: overhead = act "
    "ms/action - bare ms/call, ratio = act/bare, beyond_step = overhead - the round's no-op "
    "ms/step; medians of the per-round figures"
)


# --- the sandbox task service ----------------------------------------------------------------
@contextmanager
def sandbox(var_dir: Path) -> Iterator[str]:
    """`manage.py sandbox_tasks` on a free port with its own data file; yields its URL and
    stops it on the way out. It gets a SQLite DATABASE_URL of its own (it never opens it), so
    nothing it does can show in the bench database's counters."""
    port = free_port()
    data = var_dir / "sandbox-tasks.sqlite3"
    log_path = var_dir / "sandbox-tasks.log"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "DEBUG": "1",
        "DATABASE_URL": f"sqlite:///{var_dir / 'sandbox-django.sqlite3'}",
        "HOLDPOINT_VAR_DIR": str(var_dir),
        "PYTHONUNBUFFERED": "1",
    }
    command = [sys.executable, str(ROOT / "manage.py"), "sandbox_tasks", "--port", str(port)]
    command += ["--mode", SANDBOX_MODE, "--data", str(data)]
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(url, proc, log_path)
        log(f"sandbox task service (mode {SANDBOX_MODE}) up at {url}, pid {proc.pid}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_until_up(url: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sandbox exited ({proc.returncode}): {log_path.read_text()}")
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"sandbox not up at {url} after 30s: {log_path.read_text()}")


# --- the benchmark ---------------------------------------------------------------------------
class LedgerBench:
    """Rounds of (act, bare) on top of a prepared `Bench` (tenant, counters: `BenchHost`)."""

    def __init__(self, bench: BenchHost, url: str, actions: int) -> None:
        from audit.canonical import canonical_bytes
        from runtime.tools import get_tool

        self.bench = bench
        self.url = url.rstrip("/")
        self.n = actions
        self.tool = get_tool("tasks.create")
        # Exactly the bytes the ledger stores for bench-act's params (and sends).
        self.bodies = [canonical_bytes({"title": f"bench {i}"}) for i in range(1, actions + 1)]
        self.sent = 0  # requests that created a task so far (act and bare)
        self.batches = 0

    # A: one bench-act run through advance_run
    def act_once(self) -> dict[str, Any]:
        from runtime.executor import advance_run
        from runtime.lifecycle import create_run

        run = create_run(self.bench.tenant, "bench-act", {"steps": self.n}, actor="bench")
        before = self.bench.counters()
        cpu, t0 = CpuMark(), time.perf_counter()
        result = advance_run(run.run_id, "bench", slice_seconds=3600)
        t1, cpu_seconds = time.perf_counter(), cpu.seconds()
        after = self.bench.counters()
        self.sent += self.n
        self.check_run(run, result)
        return {
            "seconds": t1 - t0,
            "cpu": cpu_seconds,
            "delta": self.bench.delta(before, after),
            "run_id": str(run.run_id),
        }

    def check_run(self, run: Any, result: Any) -> None:
        from runtime.models import Action, ActionStatus, RunStatus

        run.refresh_from_db()
        confirmed = Action.objects.filter(run=run, status=ActionStatus.CONFIRMED).count()
        if not (
            result.outcome == "completed"
            and result.steps == self.n
            and run.status == RunStatus.COMPLETED
            and confirmed == self.n == Action.objects.filter(run=run).count()
        ):
            raise RuntimeError(
                f"bench-act run {run.run_id} did not complete as expected: {result}, "
                f"{confirmed}/{self.n} actions confirmed, last error {run.last_error!r}"
            )

    # B: the same requests, bare
    def bare_once(self) -> dict[str, Any]:
        self.batches += 1
        run_id = f"bench-bare-{os.getpid()}-{self.batches}"
        built = [
            self.tool.build_request(  # type: ignore[attr-defined]  (tasks.create: an http tool)
                {}, params_text=body.decode(), key=f"{run_id}:{i}", fence=1, run_id=run_id
            )
            for i, body in enumerate(self.bodies, 1)
        ]
        from django.conf import settings

        from runtime.wire import USER_AGENT, origin

        url = httpx.URL(built[0].url)
        # What send() puts on the wire beside the tool's own headers.
        own = {"Host": url.netloc.decode(), "Accept-Encoding": "identity", "User-Agent": USER_AGENT}
        requests = [(r.content, {**r.headers, **own}) for r in built]
        target, port = url.raw_path.decode(), url.port or 80
        limit = settings.HOLDPOINT_TOOL_MAX_RESPONSE_BYTES
        before = self.bench.counters()
        cpu, t0 = CpuMark(), time.perf_counter()
        # The same connection pool Holdpoint's http tools use, so only the ledger differs.
        pool = origin(url.scheme, url.host, url.host, port)
        responses = []
        for content, headers in requests:
            deadline = time.monotonic() + self.tool.timeout
            responses.append(
                pool.exchange(
                    "POST",
                    target,
                    headers,
                    content,
                    timeout=self.tool.timeout,
                    limit=limit,
                    deadline=deadline,
                )
            )
        t1, cpu_seconds = time.perf_counter(), cpu.seconds()
        after = self.bench.counters()
        self.sent += len(requests)
        bad = [r for r in responses if r.status_code != 201 or not r.json().get("id")]
        if bad:
            raise RuntimeError(f"bare call answered {bad[0].status_code}: {bad[0].text[:300]}")
        return {"seconds": t1 - t0, "cpu": cpu_seconds, "delta": self.bench.delta(before, after)}

    def verify(self, act_run_id: str) -> int:
        """Exactly one task per request sent so far; the act run's tasks are its actions."""
        from runtime.models import Action

        tasks = httpx.get(self.url + "/tasks", timeout=30).json()
        keys = [t["idempotency_key"] for t in tasks]
        if len(tasks) != self.sent or len(set(keys)) != len(keys):
            raise RuntimeError(
                f"sandbox holds {len(tasks)} tasks ({len(set(keys))} distinct keys), "
                f"expected exactly {self.sent}: one per action or bare call"
            )
        mine = {(t["idempotency_key"], t["id"]) for t in tasks if t["run_id"] == act_run_id}
        ledger = set(
            Action.objects.filter(run_id=act_run_id).values_list("idempotency_key", "external_id")
        )
        if mine != ledger or len(mine) != self.n:
            raise RuntimeError(
                f"run {act_run_id}: the sandbox's tasks {sorted(mine)} are not the ledger's "
                f"confirmed actions {sorted(ledger)}"
            )
        return len(tasks)

    def warm_up(self) -> None:
        self.verify(self.act_once()["run_id"])
        self.bare_once()

    def round(self, r: int, noop_ms_per_step: float, overhead: dict[str, float]) -> dict:
        a = self.act_once()
        b = self.bare_once()
        tasks = self.verify(a["run_id"])
        n = self.n
        act_ms, bare_ms = a["seconds"] * 1000 / n, b["seconds"] * 1000 / n
        row: dict[str, Any] = {
            "round": r,
            "act_ms_per_action": act_ms,
            "bare_ms_per_call": bare_ms,
            "noop_ms_per_step": noop_ms_per_step,
            "overhead_ms_per_action": act_ms - bare_ms,
            "ratio": act_ms / bare_ms,
            "beyond_step_ms_per_action": act_ms - bare_ms - noop_ms_per_step,
            "act_cpu_ms_per_action": a["cpu"] * 1000 / n,
            "bare_cpu_ms_per_call": b["cpu"] * 1000 / n,
            # The machine's speed moves by a third within an hour (README): the same round's
            # bare call is the yardstick that moves with it.
            "cpu_over_bare_cpu": a["cpu"] / b["cpu"],
            "sandbox_tasks_after_round": tasks,
        }
        if self.bench.pg:
            row["act_per_action"] = self.bench.per_step(a["delta"], overhead, n)
            row["bare_per_call"] = self.bench.per_step(b["delta"], overhead, n)
            row["act_counter_delta"] = a["delta"]
            row["bare_counter_delta"] = b["delta"]
        log(
            f"[{self.bench.backend}] round {r}: act {act_ms:.2f} ms/action, bare "
            f"{bare_ms:.2f} ms/call, overhead {act_ms - bare_ms:.2f} ms, ratio "
            f"{row['ratio']:.3f}, beyond a step {row['beyond_step_ms_per_action']:.2f} ms, "
            f"cpu {row['act_cpu_ms_per_action']:.2f} vs {row['bare_cpu_ms_per_call']:.2f} ms; "
            f"sandbox holds {tasks} tasks"
        )
        return row

    # counters outside the timed rounds
    def statements_per_action(self) -> dict[str, Any]:
        from runtime.executor import advance_run
        from runtime.lifecycle import create_run

        run = create_run(self.bench.tenant, "bench-act", {"steps": self.n}, actor="bench")
        seen, commits = self.bench.traced(
            lambda: advance_run(run.run_id, "bench", slice_seconds=3600)
        )
        self.sent += self.n
        self.verify(str(run.run_id))
        # What a run costs beside its steps (taking the lease): a no-op run of as many steps
        # tells, and is left out, so the figure is each action's own — its step's commit
        # included, as one un-gated action is one step here.
        noop = create_run(self.bench.tenant, "bench-noop", {"steps": self.n}, actor="bench")
        _, noop_commits = self.bench.traced(
            lambda: advance_run(noop.run_id, "bench", slice_seconds=3600)
        )
        per_run = noop_commits - self.n
        return {
            "per_action": len(seen) / self.n,
            "durable_commits_per_action": (commits - per_run) / self.n,
            "durable_commits_per_run_beside_steps": per_run,
            "run_statements": statement_kinds(seen),
        }

    def client_build_ms(self, times: int = 20) -> dict[str, float]:
        """What building (and closing) one httpx.Client costs, as httpx.post does per call."""
        timeout = httpx.Timeout(self.tool.timeout)
        cpu, t0 = CpuMark(), time.perf_counter()
        for _ in range(times):
            httpx.Client(timeout=timeout).close()
        t1, cpu_seconds = time.perf_counter(), cpu.seconds()
        return {"wall_ms": (t1 - t0) * 1000 / times, "cpu_ms": cpu_seconds * 1000 / times}

    def profile(self) -> dict[str, Any]:
        from runtime.executor import advance_run
        from runtime.lifecycle import create_run

        run = create_run(self.bench.tenant, "bench-act", {"steps": self.n}, actor="bench")
        top = profile_call(
            lambda: advance_run(run.run_id, "bench", slice_seconds=3600),
            f"act-{self.bench.backend}",
        )
        self.sent += self.n
        self.verify(str(run.run_id))
        return {"actions": self.n, "top_cumulative": top}

    def results(self, rows: list[dict[str, Any]], profile: bool) -> dict[str, Any]:
        def col(key: str, sub: str | None = None) -> list[float]:
            return [r[key][sub] if sub else r[key] for r in rows]

        keys = [k for k, v in rows[0].items() if isinstance(v, float)]
        out: dict[str, Any] = {
            "actions_per_run": self.n,
            "sandbox_mode": SANDBOX_MODE,
            **{k: summary(col(k)) for k in keys},
        }
        if self.bench.pg:
            for side in ("act_per_action", "bare_per_call"):
                out[side] = {k: summary(col(side, k)) for k in rows[0][side]}
        out["statements"] = self.statements_per_action()
        out["httpx_client_build"] = self.client_build_ms()
        if profile:
            out["profile"] = self.profile()
        out["sandbox_tasks_total"] = self.sent
        out["per_round"] = rows
        return out


# --- report ----------------------------------------------------------------------------------
def markdown_section(report: dict[str, Any]) -> list[str]:
    backends = {name: b["ledger"] for name, b in report["backends"].items() if "ledger" in b}
    if not backends:
        return []
    n = next(iter(backends.values()))["actions_per_run"]
    lines = [
        "",
        "## Side-effect overhead",
        "",
        f"One `tasks.create` through the ledger (`ctx.act`: the prepare checkpoint that also "
        f"commits `sent`, the HTTP call, then the step commit that writes the outcome) against "
        f"the same request sent "
        f"bare to the same sandbox task service (mode {SANDBOX_MODE}, its own "
        f"process). Per round: A = a `bench-act` run of {n} actions, ms per action; B = {n} bare "
        "calls (same bytes, same headers, through the connection pool "
        "http tools use), ms "
        "per call; noop = the same round's no-op step, ms per step. Median (min–max) over the "
        "rounds.",
        "",
        "| backend | A ms/action | B ms/call | overhead A−B ms | ratio A/B | no-op step ms "
        "| A−B−noop ms | client CPU ms/action | bare CPU ms/call | SQL statements/action "
        "| durable commits/action (its step's included, the run's lease take not) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, x in backends.items():
        lines.append(
            f"| {name} | {spread(x['act_ms_per_action'], 2)} | {spread(x['bare_ms_per_call'], 2)}"
            f" | {spread(x['overhead_ms_per_action'], 2)} | {spread(x['ratio'], 3)}"
            f" | {spread(x['noop_ms_per_step'], 2)} | {spread(x['beyond_step_ms_per_action'], 2)}"
            f" | {spread(x['act_cpu_ms_per_action'], 2)} | {spread(x['bare_cpu_ms_per_call'], 2)}"
            f" | {x['statements']['per_action']:.2f}"
            f" | {x['statements'].get('durable_commits_per_action', float('nan')):.2f} |"
        )
    pg = backends.get("postgres")
    if pg:
        a, b = pg["act_per_action"], pg["bare_per_call"]
        lines += [
            "",
            "PostgreSQL server counters (median per action / per bare call; same sources as "
            "above):",
            "",
            "| per | server txns | WAL fsyncs | WAL bytes |",
            "| --- | --- | --- | --- |",
            f"| action through the ledger (step commit included) | {a['server_txns']['median']:.2f}"
            f" | {a['wal_fsyncs']['median']:.2f} | {fmt(a['wal_bytes']['median'])} |",
            f"| bare HTTP call | {b['server_txns']['median']:.2f} | {b['wal_fsyncs']['median']:.2f}"
            f" | {fmt(b['wal_bytes']['median'])} |",
        ]
    lines += [
        "",
        f"SQL statements Django sent for one whole {n}-action run (BEGIN/COMMIT not counted):",
        "",
    ]
    for name, x in backends.items():
        kinds = x["statements"]["run_statements"]
        lines.append(f"- {name}: " + ", ".join(f"{k} ×{v}" for k, v in kinds.items()))
    lines += ["", "Building one `httpx.Client` (what module-level `httpx.post` does per call):", ""]
    for name, x in backends.items():
        c = x["httpx_client_build"]
        lines.append(f"- {name}: {c['wall_ms']:.2f} ms wall, {c['cpu_ms']:.2f} ms CPU")
    lines += [
        "",
        "After every round the sandbox held exactly one task per request sent (actions and bare "
        "calls), and each run's tasks were exactly its confirmed actions: "
        + ", ".join(f"{name} {x['sandbox_tasks_total']} tasks" for name, x in backends.items())
        + ".",
    ]
    return lines


def plot(axes: Any, backends: dict[str, Any]) -> None:
    """One panel per backend: per-round ms per action, per bare call, per no-op step."""
    from matplotlib.ticker import MaxNLocator

    for ax, (name, b) in zip(axes, backends.items(), strict=True):
        x = b.get("ledger")
        if not x:
            ax.set_axis_off()
            continue
        rows = x["per_round"]
        rounds = [r["round"] for r in rows]
        ax.plot(rounds, [r["act_ms_per_action"] for r in rows], "s-", label="ms / action (ledger)")
        ax.plot(rounds, [r["bare_ms_per_call"] for r in rows], "o-", label="ms / bare HTTP call")
        ax.plot(rounds, [r["noop_ms_per_step"] for r in rows], "^-", label="ms / no-op step")
        ax.set_title(
            f"{name}: +{x['overhead_ms_per_action']['median']:.1f} ms/action, "
            f"ratio {x['ratio']['median']:.2f}"
        )
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(bottom=0)
        ax.legend(fontsize="small")
