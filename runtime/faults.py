"""Named fault points for crash testing (API.md, "Fault points").

A worker started with HOLDPOINT_FAULTS=<point>[,<point>…] logs the point and SIGKILLs its
whole process group the first time it reaches one of them — a machine crash, with no cleanup
and no lease release. HOLDPOINT_PAUSE=<point>[,…] instead stops the process itself (SIGSTOP,
as a long GC pause or a frozen VM would) until someone sends SIGCONT. Both are read once, at
import; unset, a point costs one set lookup.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

log = logging.getLogger("holdpoint.faults")


def _points(name: str) -> frozenset[str]:
    return frozenset(p.strip() for p in os.environ.get(name, "").split(",") if p.strip())


ARMED = _points("HOLDPOINT_FAULTS")
PAUSES = set(_points("HOLDPOINT_PAUSE"))


def fault(point: str) -> None:
    if point in PAUSES:
        PAUSES.discard(point)  # once
        _flush(f"fault point reached: {point} — pausing pid={os.getpid()}")
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    if point not in ARMED:
        return
    _flush(f"fault point reached: {point} — killing process group")
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _flush(message: str) -> None:
    log.critical(message)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
