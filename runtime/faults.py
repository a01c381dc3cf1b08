"""Named fault points for crash testing (API.md and README, "Fault points").

A worker started with HOLDPOINT_FAULTS=<point>[,<point>…] logs the point and SIGKILLs its
whole process group the first time it reaches one of them — a machine crash, with no cleanup
and no lease release. HOLDPOINT_PAUSE=<point>[,…] instead stops the process itself (SIGSTOP,
as a long GC pause or a frozen VM would) until someone sends SIGCONT. Both are read once, at
import (which `django.setup()` reaches through the graph modules); unset, a point costs two
truthiness checks.

The points are one enum shared by the code that reaches them, the chaos driver that arms
them and the tests that crash at them, and the environment is checked against it: a typo in
a crash test (`after_prepar`) would otherwise arm nothing, the worker would never die, and
the test would pass for the wrong reason. An unknown name stops the process at start with
the list of valid ones.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Mapping
from enum import StrEnum

from django.core.exceptions import ImproperlyConfigured

log = logging.getLogger("holdpoint.faults")


class FaultPoint(StrEnum):
    """Where a worker can be made to crash (or freeze), in the order a step meets them."""

    BEFORE_PREPARE = "before_prepare"
    AFTER_PREPARE = "after_prepare"
    AFTER_SENT_MARK = "after_sent_mark"
    # The effect happened in the service; nothing about it is recorded yet.
    AFTER_TOOL_RESPONSE = "after_tool_response"
    AFTER_CONFIRM = "after_confirm"
    AFTER_CHECKPOINT = "after_checkpoint"
    DURING_RECONCILE = "during_reconcile"
    # A paid call is recorded; its step is not committed.
    AFTER_RECORD = "after_record"
    # The web server's, around a creating POST with an Idempotency-Key: the key is claimed,
    # the work not begun; the work committed, its response not stored.
    AFTER_KEY_CLAIMED = "after_key_claimed"
    BEFORE_KEY_RESPONSE = "before_key_response"


# Reached by a web server serving a request, never by a worker running a step.
REQUEST_POINTS = frozenset({FaultPoint.AFTER_KEY_CLAIMED, FaultPoint.BEFORE_KEY_RESPONSE})
WORKER_POINTS = tuple(p for p in FaultPoint if p not in REQUEST_POINTS)


def points_from(name: str, environ: Mapping[str, str] = os.environ) -> frozenset[FaultPoint]:
    """The fault points an environment variable names (comma-separated; blanks ignored).

    Raises ImproperlyConfigured for any name that is not a FaultPoint, listing the valid ones.
    """
    names = [p.strip() for p in environ.get(name, "").split(",") if p.strip()]
    unknown = [n for n in names if n not in FaultPoint._value2member_map_]
    if unknown:
        raise ImproperlyConfigured(
            f"{name} names unknown fault point(s) {', '.join(map(repr, unknown))}; "
            f"valid points: {', '.join(FaultPoint)}"
        )
    return frozenset(FaultPoint(n) for n in names)


ARMED = points_from("HOLDPOINT_FAULTS")
PAUSES = set(points_from("HOLDPOINT_PAUSE"))


def fault(point: FaultPoint) -> None:
    """Crash (or freeze) here if this point is armed; otherwise nothing."""
    if not (ARMED or PAUSES):
        return
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
