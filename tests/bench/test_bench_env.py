"""The environment the bench gives its processes (bench/common.py `bench_env`): the developer's
Holdpoint settings stay out — a bench measures the defaults on its scratch database — except
the one an A/B of the worker processes needs."""

from __future__ import annotations

import pytest

from bench.common import bench_env


def test_the_overlap_setting_reaches_the_bench_workers_and_nothing_else_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HOLDPOINT_OVERLAP_COMMITS", "0")
    monkeypatch.setenv("HOLDPOINT_LEASE_TTL", "99")
    monkeypatch.setenv("REDIS_URL", "redis://elsewhere:6379/0")
    env = bench_env("postgres://postgres@127.0.0.1:5432/scratch", "/tmp/bench-var")
    assert env["HOLDPOINT_OVERLAP_COMMITS"] == "0"
    assert "HOLDPOINT_LEASE_TTL" not in env and "REDIS_URL" not in env
    assert env["DATABASE_URL"] == "postgres://postgres@127.0.0.1:5432/scratch"
