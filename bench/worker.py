"""A worker process for bench/scaling.py: the executor, without the queue in between.

Started with the bench environment (bench/common.py `bench_env`) of a scratch database.
Prints {"ready": …} once Django is up, then answers one JSON line per command on stdin:

    {"runs": ["<run id>", …], "owner": "w1"}  → advance_run() each, in order; answers
        {"steps", "started", "ended" (time.time()), "cpu", "outcomes"}
    {"quit": true}                             → exits

Each run goes through `runtime.executor.advance_run`, the call a qcluster worker makes for a
doorbell (runtime.tasks.advance); leaving django-q2's broker out measures the engine and the
database, not the broker's polling.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    import django

    django.setup()
    from django.conf import settings

    settings.DEBUG = False
    from runtime.executor import advance_run

    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        outcomes: Counter[str] = Counter()
        steps = 0
        cpu0, started = time.process_time(), time.time()
        errors = []
        for run_id in command["runs"]:
            try:
                result = advance_run(run_id, command.get("owner"), slice_seconds=3600)
            except Exception as exc:  # the engine under test raised: report, go on
                errors.append(f"{type(exc).__name__}: {exc}"[:500])
                outcomes["exception"] += 1
                continue
            outcomes[result.outcome] += 1
            steps += result.steps
        ended, cpu1 = time.time(), time.process_time()
        answer = {
            "steps": steps,
            "started": started,
            "ended": ended,
            "cpu": cpu1 - cpu0,
            "outcomes": dict(outcomes),
            "errors": errors[:3],
        }
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
