"""What a chaos soak is asked to do, and the fixed workload it runs (see `chaos`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.faults import WORKER_POINTS

GRAPH = "api-review"
GOAL: dict[str, Any] = {
    "old_spec": "shop-v1",
    "new_spec": "shop-v2",
    "scope": ["/orders", "/users"],
    "create_review_task": True,
}
HUMAN = "user:chaos"
# Where a restarted worker may be armed to die: every point the code has.
FAULT_POINTS = WORKER_POINTS
MODES = ("key", "lookup", "none")
ChildEnv = Mapping[str, str] | Callable[[], Mapping[str, str]]


class ChaosAborted(RuntimeError):
    """The harness itself cannot go on (the sandbox or the workers do not run)."""


@dataclass
class ChaosConfig:
    runs: int
    kill_every: float
    mode: str = "key"
    workers: int = 2
    tenant: str = "demo"
    seed: int | None = None
    timeout: float = 600.0
    # Runs started per second (0: all at once). A run takes a second or two, so started all
    # at once they would be done before the first kill; spread out, kills land mid-run.
    rate: float = 1.0
    # Seconds our sandbox waits before applying each create: widens the window between
    # `sent` and the reply, where a kill leaves an outcome only reconciliation can settle.
    service_delay: float = 0.0
    # An operator's own task service: then only GET /tasks is used, no sandbox is started.
    tasks_url: str | None = None
    # The environment of every child process (os.environ when None); tests pass
    # tests.procs.child_env so workers use the test database.
    env: ChildEnv | None = None
    log_dir: Path | None = None
    sweep_interval: float = 0.5
    grace: float = 5.0
    # A run is rung again at most this often: a queued run's doorbell is usually still in
    # the queue, and a flood of duplicates only delays the real work behind them.
    ring_gap: float = 3.0

    def __post_init__(self) -> None:
        if self.runs < 1 or self.workers < 1:
            raise ValueError("runs and workers must be at least 1")
        if self.kill_every <= 0:
            raise ValueError("kill_every must be positive")
        if min(self.rate, self.service_delay, self.grace) < 0:
            raise ValueError("rate, service_delay and grace must not be negative")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}")
