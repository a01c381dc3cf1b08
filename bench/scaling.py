"""Scaling: the same work done by one worker process and by two, rounds interleaved.

Two worker processes (bench/worker.py: django.setup() on the bench database, then
`advance_run` for each run id it is sent) are started once. Each round creates
`runs` × bench-noop runs of `steps` steps (not timed), then either sends them all to worker 1
or splits them between workers 1 and 2 (independent runs: no run is shared, so the only
contention is the database itself). Throughput = steps committed ÷ wall time from the first
worker's start to the last worker's end. Rounds alternate 1, 2, 1, 2, …; the per-pair ratio
is (2 workers' steps/s) ÷ (the neighbouring 1 worker's steps/s), and the report gives the
median ratio. Every run must end completed with all its steps.

Rounds are 32 runs by default (`--scaling-runs`; 1,600 steps, ~1.5 s for one worker on
PostgreSQL). With the 8 runs of earlier benches a two-worker round lasted ~0.2 s, and the
wake-up skew between the two workers (each reads its command from a pipe) and their uneven
finish counted against two workers alone: on the same machine, the same hour, 8-run rounds
gave medians of 1.61 and 1.73 (pairs 1.07–2.13), 32-run rounds 1.94 and 1.96 (1.19–2.37).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.common import ROOT, bench_env, kill_group, log, start_process, summary


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat's first line
    (user nice system idle iowait irq softirq steal; idle and iowait are not busy)."""
    with open("/proc/stat") as stat:
        fields = [float(v) for v in stat.readline().split()[1:9]]
    ticks = os.sysconf("SC_CLK_TCK")
    total = sum(fields) / ticks
    return total - (fields[3] + fields[4]) / ticks, total


def busy_share(before: tuple[float, float], after: tuple[float, float]) -> float:
    """Cores kept busy between two `machine_cpu` readings."""
    cores = os.cpu_count() or 1
    elapsed = after[1] - before[1]
    return (after[0] - before[0]) / elapsed * cores if elapsed > 0 else 0.0


class ScalingBench:
    def __init__(
        self, bench: Any, database_url: str, var_dir: str, runs: int = 32, steps: int = 50
    ) -> None:
        self.bench = bench
        self.database_url = database_url
        self.var_dir = var_dir
        self.runs = runs
        self.steps = steps
        self.workers: list[Any] = []

    def start(self) -> None:
        env = bench_env(self.database_url, self.var_dir)
        for n in (1, 2):
            proc = start_process(
                [sys.executable, str(ROOT / "bench" / "worker.py")],
                env,
                stdin=-1,  # subprocess.PIPE
                stdout=-1,
                stderr=open(Path(self.var_dir) / f"worker{n}.log", "ab"),  # noqa: SIM115
                text=True,
                bufsize=1,
            )
            self.workers.append(proc)
        for proc in self.workers:
            ready = json.loads(proc.stdout.readline() or "{}")
            if not ready.get("ready"):
                raise RuntimeError(f"worker {proc.pid} did not start: see {self.var_dir}")

    def stop(self) -> None:
        for proc in self.workers:
            try:
                proc.stdin.write(json.dumps({"quit": True}) + "\n")
                proc.stdin.flush()
                proc.wait(timeout=10)
            except Exception:
                pass
            kill_group(proc)
        self.workers = []

    def answer(self, k: int) -> dict[str, Any]:
        line = self.workers[k].stdout.readline()
        if not line:
            log_path = Path(self.var_dir) / f"worker{k + 1}.log"
            tail = log_path.read_text(errors="replace")[-1500:] if log_path.exists() else ""
            raise RuntimeError(f"worker {k + 1} died: {tail}")
        return json.loads(line)

    def round(self, workers: int) -> dict[str, Any]:
        from runtime.lifecycle import create_run
        from runtime.models import Run, RunStatus

        runs = [
            str(
                create_run(
                    self.bench.tenant, "bench-noop", {"steps": self.steps}, actor="bench"
                ).run_id
            )
            for _ in range(self.runs)
        ]
        shares = [runs[k::workers] for k in range(workers)]
        busy_before = machine_cpu()
        for k, share in enumerate(shares):
            self.workers[k].stdin.write(json.dumps({"runs": share, "owner": f"w{k + 1}"}) + "\n")
            self.workers[k].stdin.flush()
        answers = [self.answer(k) for k in range(workers)]
        busy_after = machine_cpu()
        done = Run.objects.filter(run_id__in=runs, status=RunStatus.COMPLETED).count()
        steps = sum(a["steps"] for a in answers)
        if done != len(runs) or steps != len(runs) * self.steps:
            raise RuntimeError(f"scaling round: {done}/{len(runs)} runs completed, {answers}")
        wall = max(a["ended"] for a in answers) - min(a["started"] for a in answers)
        busy = busy_share(busy_before, busy_after)
        return {
            "workers": workers,
            "steps": steps,
            "seconds": wall,
            "steps_per_s": steps / wall,
            "cpu_ms_per_step": sum(a["cpu"] for a in answers) * 1000 / steps,
            # every process of the machine (workers, the database server, the bench), in
            # cores: near the core count, two workers are bound by the hardware, not locks
            "machine_cores_busy": busy,
            # the same, per committed step, in ms
            "machine_cpu_ms_per_step": busy * wall / steps * 1000,
        }

    def go(self, pairs: int) -> dict[str, Any]:
        self.start()
        try:
            self.round(1)  # warm-up: connections, imports, plans in both workers
            self.round(2)
            rows, ratios, ceilings = [], [], []
            cores = os.cpu_count() or 1
            for p in range(1, pairs + 1):
                one = self.round(1)
                two = self.round(2)
                ratio = two["steps_per_s"] / one["steps_per_s"]
                rows += [one, two]
                ratios.append(ratio)
                # What two workers could reach at most on this machine: each as fast as one
                # alone, and the CPU one keeps busy (its own, the server's for it) twice
                # over, up to every core. Where one worker already keeps more than half the
                # cores busy, 2 ÷ 1 cannot reach 2, whatever the code does about locks.
                ceilings.append(min(2.0, cores / max(one["machine_cores_busy"], 1e-9)))
                log(
                    f"[{self.bench.backend}] scaling pair {p}/{pairs}: 1 worker "
                    f"{one['steps_per_s']:.0f} steps/s, 2 workers {two['steps_per_s']:.0f}"
                    f" steps/s, ratio {ratio:.2f}"
                )
        finally:
            self.stop()

        def rounds_of(workers: int, key: str) -> list[float]:
            return [r[key] for r in rows if r["workers"] == workers]

        one_rates, two_rates = rounds_of(1, "steps_per_s"), rounds_of(2, "steps_per_s")
        return {
            "cores": os.cpu_count(),
            "ceiling": summary(ceilings),
            "one_worker_machine_cpu_ms_per_step": summary(rounds_of(1, "machine_cpu_ms_per_step")),
            "two_workers_machine_cpu_ms_per_step": summary(rounds_of(2, "machine_cpu_ms_per_step")),
            "one_worker_cores_busy": summary(rounds_of(1, "machine_cores_busy")),
            "two_workers_cores_busy": summary(rounds_of(2, "machine_cores_busy")),
            "runs_per_round": self.runs,
            "steps_per_run": self.steps,
            "one_worker_steps_per_s": summary(one_rates),
            "two_workers_steps_per_s": summary(two_rates),
            "ratio": summary(ratios),
            "ratio_median": statistics.median(ratios),
            "per_round": rows,
        }
