"""The `tool` label of holdpoint_action_duration_seconds is a tenant's word (it names the
tools tenants define): bounded per host by HOLDPOINT_METRICS_TOOL_LABELS, every further tool
counted under `_other`, each value cut to 100 characters — in one process's scrape, and
across the processes whose files a scrape sums (API.md, "Metrics"; runtime.metrics)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from runtime import metrics
from tests import procs
from tests.ops.metrics import scrape

COUNT = "holdpoint_action_duration_seconds_count"
OTHER = "_other"

# A process that times one request of each tool named on its command line, then exits (a
# worker recycled by django-q2). RAW writes the histogram past the bound, as a process
# running a release from before it did.
OBSERVE = """
import sys, django
django.setup()
from runtime import metrics
for name in sys.argv[1:]:
    metrics.observe_action(name, metrics.clock())
"""
RAW = """
import sys, django
django.setup()
from runtime.metrics import ACTION_SECONDS
for name in sys.argv[1:]:
    ACTION_SECONDS.labels(tool=name).observe(0.01)
"""


def _counts(samples: dict[tuple[str, Any], float]) -> dict[str, float]:
    """Requests per `tool` value in one scrape."""
    return {dict(labels)["tool"]: n for (name, labels), n in samples.items() if name == COUNT}


def _fresh(n: int) -> list[str]:
    """Tool names no other test observed (the session's metrics directory is shared)."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    return [f"{prefix}.tool_{i}" for i in range(n)]


def test_a_tenant_with_many_tools_adds_a_bounded_number_of_series(settings: Any, db: None) -> None:
    settings.HOLDPOINT_METRICS_TOOL_LABELS = 5
    before = _counts(scrape())
    tools = _fresh(40)
    for tool in tools:
        metrics.observe_action(tool, metrics.clock())

    after = _counts(scrape())
    assert len(after) <= 5 + 1, sorted(after)
    assert sum(after.values()) - sum(before.values()) == len(tools)  # every request counted
    assert after[OTHER] - before.get(OTHER, 0) >= len(tools) - 5


def test_a_tool_name_is_cut_to_100_characters(settings: Any, db: None) -> None:
    settings.HOLDPOINT_METRICS_TOOL_LABELS = 10_000
    (prefix,) = _fresh(1)
    metrics.observe_action(prefix + "x" * 5000, metrics.clock())

    counts = _counts(scrape())
    assert all(len(tool) <= 100 for tool in counts)
    assert counts[(prefix + "x" * 5000)[:100]] == 1


def _observed_by_a_process(path: Path, program: str, tools: list[str], limit: int) -> None:
    env = procs.child_env(
        PROMETHEUS_MULTIPROC_DIR=str(path), HOLDPOINT_METRICS_TOOL_LABELS=str(limit)
    )
    subprocess.run(
        [sys.executable, "-c", program, *tools], env=env, cwd=procs.ROOT, check=True, timeout=120
    )


def _scrape_directory(path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    """/metrics's answer for a host whose processes write their files in `path`."""
    with monkeypatch.context() as patch:
        patch.setenv("PROMETHEUS_MULTIPROC_DIR", str(path))
        text = generate_latest(metrics.registry()).decode()
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    return _counts(samples)


@pytest.mark.slow
def test_the_bound_holds_across_the_processes_of_a_host(
    settings: Any, db: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each worker process names other tools, and django-q2 replaces workers: the series a
    scrape sums from every process's file (and the archive of those gone) stay bounded,
    and the tools admitted first keep their own series."""
    settings.HOLDPOINT_METRICS_TOOL_LABELS = 5
    first, second, third = _fresh(20), _fresh(20), _fresh(20)
    _observed_by_a_process(tmp_path, OBSERVE, first, 5)
    _observed_by_a_process(tmp_path, OBSERVE, second, 5)

    counts = _scrape_directory(tmp_path, monkeypatch)
    assert set(counts) == {*first[:5], OTHER}
    assert counts[OTHER] == 35 and sum(counts.values()) == 40

    _observed_by_a_process(tmp_path, OBSERVE, third, 5)  # after the fold: same five
    counts = _scrape_directory(tmp_path, monkeypatch)
    assert set(counts) == {*first[:5], OTHER}
    assert counts[OTHER] == 55 and sum(counts.values()) == 60

    # A process that wrote every tool it met (a release from before the bound): its series
    # are summed into `_other` by the scrape.
    _observed_by_a_process(tmp_path, RAW, _fresh(30), 5)
    counts = _scrape_directory(tmp_path, monkeypatch)
    assert set(counts) == {*first[:5], OTHER}
    assert counts[OTHER] == 85 and sum(counts.values()) == 90
