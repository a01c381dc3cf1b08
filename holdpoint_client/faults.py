"""Named crash points of an external agent, for crash tests (like the server's, API.md
"Fault points").

`HOLDPOINT_CLIENT_FAULTS=<point>[,<point>…]` makes the agent process log the point and
SIGKILL itself the first time it reaches one: no cleanup, no lease release, as if the
machine died there. Unset, a point costs one environment lookup. An unknown name raises at
the first point reached, so a typo in a crash test cannot arm nothing and pass.
"""

from __future__ import annotations

import os
import signal
import sys

VARIABLE = "HOLDPOINT_CLIENT_FAULTS"
POINTS = (
    # The action waits for a reviewer (durably); the agent is about to long-poll.
    "awaiting_approval",
    # The reviewer decided; nothing is dispatched yet.
    "after_decision",
    # The action is `sent`; the tool has not been called.
    "after_sent_mark",
    # The tool answered (the effect happened); nothing about it is recorded yet.
    "after_tool_response",
    # A recorded call's result is stored; the agent has not used it yet.
    "after_record",
)


def armed() -> frozenset[str]:
    names = {n.strip() for n in os.environ.get(VARIABLE, "").split(",") if n.strip()}
    unknown = names.difference(POINTS)
    if unknown:
        raise ValueError(f"{VARIABLE} names unknown point(s) {sorted(unknown)}; valid: {POINTS}")
    return frozenset(names)


def fault(point: str) -> None:
    """Die here if the environment says so."""
    if point in armed():
        print(f"holdpoint_client fault point {point}: SIGKILL", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
