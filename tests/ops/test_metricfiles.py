"""The multiprocess directory: the files of processes that are gone are folded into one
archive without changing a total, also when a fold was cut short (runtime.metricfiles)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from runtime.metricfiles import HostMetrics

OBSERVE = """
from prometheus_client import Counter, Histogram
steps = Histogram("holdpoint_step_duration_seconds", "steps", buckets=(0.5, 1))
calls = Counter("demo_calls", "calls")
for _ in range({n}):
    steps.observe(0.25)
    calls.inc()
"""


def _process_observes(path: Path, n: int) -> None:
    """A real process observes `n` steps and exits (a recycled worker)."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(path)}
    subprocess.run([sys.executable, "-c", OBSERVE.format(n=n)], env=env, check=True)


def _totals(path: Path) -> dict[str, float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(HostMetrics(str(path)))
    text = generate_latest(registry).decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in ("holdpoint_step_duration_seconds_count", "demo_calls_total")
    }


def _files(path: Path) -> list[str]:
    return sorted(n for n in os.listdir(path) if not n.startswith("."))


def test_gone_processes_are_folded_and_totals_kept(tmp_path: Path) -> None:
    for n in (3, 4):
        _process_observes(tmp_path, n)
    assert len(_files(tmp_path)) == 4  # a histogram and a counter file per process
    assert _totals(tmp_path) == {"holdpoint_step_duration_seconds_count": 7, "demo_calls_total": 7}
    assert _files(tmp_path) == ["counter_archive-g1.db", "histogram_archive-g1.db"]
    _process_observes(tmp_path, 5)
    assert _totals(tmp_path) == {
        "holdpoint_step_duration_seconds_count": 12,
        "demo_calls_total": 12,
    }
    assert _files(tmp_path) == ["counter_archive-g2.db", "histogram_archive-g2.db"]


def test_a_fold_cut_short_counts_each_file_once(tmp_path: Path) -> None:
    _process_observes(tmp_path, 2)
    _totals(tmp_path)  # archive generation 1 holds 2
    # Cut short after renaming: a dead process's file is out of the glob, in no archive yet.
    _process_observes(tmp_path, 3)
    (pid_file,) = [n for n in _files(tmp_path) if n.startswith("histogram_") and "archive" not in n]
    os.rename(tmp_path / pid_file, tmp_path / f"{pid_file}.g2")
    counts = _totals(tmp_path)
    assert counts["holdpoint_step_duration_seconds_count"] == 5
    # Cut short after the archive was written: the renamed file it includes is still there.
    _process_observes(tmp_path, 4)
    (pid_file,) = [n for n in _files(tmp_path) if n.startswith("histogram_") and "archive" not in n]
    os.rename(tmp_path / pid_file, tmp_path / f"{pid_file}.g3")
    leftover = (tmp_path / f"{pid_file}.g3").read_bytes()
    assert _totals(tmp_path)["holdpoint_step_duration_seconds_count"] == 9  # folded into g3
    (tmp_path / f"{pid_file}.g3").write_bytes(leftover)  # as if its removal never happened
    assert _totals(tmp_path)["holdpoint_step_duration_seconds_count"] == 9
    assert not any(n.endswith(".g3") for n in _files(tmp_path))
