"""Named fault points for crash testing (API.md, "Fault points").

A worker started with HOLDPOINT_FAULTS=<point>[,<point>…] logs the point and SIGKILLs its
whole process group the first time it reaches one of them — a machine crash, with no cleanup
and no lease release. The variable is read once, at import; with it unset this is one set
lookup per point.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

log = logging.getLogger("holdpoint.faults")
ARMED = frozenset(p.strip() for p in os.environ.get("HOLDPOINT_FAULTS", "").split(",") if p.strip())


def fault(point: str) -> None:
    if point not in ARMED:
        return
    log.critical("fault point reached: %s — killing process group", point)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os.killpg(os.getpgrp(), signal.SIGKILL)
