"""bench.common.CpuMark: the CPU figure the benchmark reports for Holdpoint leaves out the
peers' threads (DBOS polls in the bench process) and nothing else."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from bench.common import CpuMark, peer_threads

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="per-thread clocks by kernel thread id"),
    pytest.mark.ci_database("sqlite"),  # no database: one of CI's two suites is enough
]


def burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@contextmanager
def spinning(mark_as_peer: bool) -> Iterator[threading.Thread]:
    """A thread that uses a core until the block ends, started as a peer's or not."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    thread = threading.Thread(target=spin, daemon=True)
    if mark_as_peer:
        with peer_threads():
            thread.start()
    else:
        thread.start()
    try:
        yield thread
    finally:
        stop.set()
        thread.join()


def test_a_peers_thread_is_left_out() -> None:
    with spinning(mark_as_peer=True):
        mark, process = CpuMark(), time.process_time()
        time.sleep(0.4)  # the peer's thread spins meanwhile; this one does nothing
        own, whole = mark.seconds(), time.process_time() - process
    assert whole > 0.1, "the peer's thread did not run: the test shows nothing"
    assert own < 0.05, f"{own:.3f} s of the peer's CPU counted as Holdpoint's"


def test_the_callers_own_work_is_counted() -> None:
    with spinning(mark_as_peer=True):
        mark = CpuMark()
        burn(0.2)
        own = mark.seconds()
    assert 0.19 < own < 0.35


def test_a_thread_not_started_by_a_peer_is_counted() -> None:
    """Holdpoint work done in a thread of its own must not vanish from the figure."""
    mark = CpuMark()
    with spinning(mark_as_peer=False):
        time.sleep(0.3)
    assert mark.seconds() > 0.1
