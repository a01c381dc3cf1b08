"""Helpers both benchmarks use (bench/run.py and bench/ledger.py)."""

from __future__ import annotations

import re
import statistics
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def summary(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


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
