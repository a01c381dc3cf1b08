"""bench.common.CpuMark: the CPU figure the benchmark reports for Holdpoint leaves out the
peers' threads (DBOS polls in the bench process) and nothing else."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from bench.common import CpuMark, peer_threads

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="per-thread clocks by kernel thread id"),
    pytest.mark.ci_database("sqlite"),  # no database: one of CI's two suites is enough
]


def burn(seconds: float) -> None:
    """Use `seconds` of this thread's CPU, however busy the machine is."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class Burner:
    """A thread that burns `seconds` of CPU once told to, then waits (alive, idle) until
    let go: its CPU is known exactly whatever else the machine runs."""

    def __init__(self, seconds: float, *, peer: bool) -> None:
        self.go, self.burnt, self.done = threading.Event(), threading.Event(), threading.Event()
        self.seconds = seconds
        self.thread = threading.Thread(target=self._run, daemon=True)
        if peer:
            with peer_threads():
                self.thread.start()
        else:
            self.thread.start()

    def _run(self) -> None:
        self.go.wait(60)
        burn(self.seconds)
        self.burnt.set()
        self.done.wait(60)

    def burn_now(self) -> None:
        self.go.set()
        assert self.burnt.wait(60), "the thread never got the CPU"

    def stop(self) -> None:
        self.done.set()
        self.thread.join(60)


def test_a_peers_thread_is_left_out() -> None:
    burner = Burner(0.2, peer=True)
    try:
        mark, process = CpuMark(), time.process_time()
        burner.burn_now()  # the peer's thread burns 0.2 s; this one waits
        own, whole = mark.seconds(), time.process_time() - process
    finally:
        burner.stop()
    assert whole >= 0.19
    assert own < 0.05, f"{own:.3f} s of the peer's CPU counted as Holdpoint's"


def test_the_callers_own_work_is_counted() -> None:
    burner = Burner(0.1, peer=True)
    try:
        mark = CpuMark()
        burner.burn_now()
        burn(0.2)
        own = mark.seconds()
    finally:
        burner.stop()
    assert 0.19 < own < 0.28


def test_a_thread_not_started_by_a_peer_is_counted() -> None:
    """Holdpoint work done in a thread of its own must not vanish from the figure."""
    burner = Burner(0.2, peer=False)
    try:
        mark = CpuMark()
        burner.burn_now()
        own = mark.seconds()
    finally:
        burner.stop()
    assert own >= 0.19
