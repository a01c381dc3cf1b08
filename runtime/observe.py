"""The hooks the executor and the dispatcher call where a run is taken, a step begins and
ends, and an action is sent: each feeds the metrics (runtime.metrics) and binds what the log
lines that follow are about (runtime.logs). One call per site keeps those modules readable.
"""

from __future__ import annotations

from typing import Any

from runtime import logs, metrics


def lease_taken(lease: Any) -> None:
    logs.bind_lease(lease.run_id, lease.tenant_id, lease.fence)


def step_begins() -> float:
    """A step starts: no action is in hand yet. Returns the clock reading `step_done` takes."""
    logs.bind_action(None)
    return metrics.clock()


def step_done(began: float) -> None:
    metrics.observe_step(began)


def sending(action: Any) -> float:
    """The request for `action` leaves now. Returns the clock reading `answered` takes."""
    logs.bind_action(action.action_id)
    return metrics.clock()


def answered(action: Any, began: float) -> None:
    metrics.observe_action(action.tool, began)
