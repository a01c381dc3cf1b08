"""The one narrow interface through which the runtime consults hold points.

`runtime` knows nothing of `approvals` (DESIGN.md layering). The approvals app registers a
`HoldPoints` implementation at start-up; without one, only a tool's own static declaration
counts and nothing can approve (actions needing approval simply wait).
"""

from __future__ import annotations

from typing import Any, Protocol

from runtime.models import Action


class HoldPoints(Protocol):
    def needs_approval(self, tool: Any, params: dict[str, Any], run: Any) -> bool:
        """Whether this action must wait for a human decision before it may be sent."""

    def hold(self, action: Action, run: Any, actor: str) -> None:
        """The action waits (awaiting_approval): make sure an open request exists for it.
        Called inside the transaction that prepared (or re-held) the action."""

    def check_dispatch(self, action: Action, actor: str) -> str | None:
        """Inside the transaction that would mark the action sent (its row locked): None if
        it may go, else the refusal code after superseding what no longer holds."""

    def may_hold(self, action: Action) -> bool:
        """Inside the dispatch transaction (the run row locked), cheaply: False only when no
        hold point can apply to the action — no request for it, no policy for its tool, no
        approval declared by the tool — so `check_dispatch` would certainly return None."""

    def withdrawn(self, action_ids: list[str], reason: str, actor: str) -> None:
        """Actions were cancelled (goal revised, run cancelled): close their requests."""

    def sweep(self) -> int:
        """Periodic work (expiry, reminders, escalation); returns how much was done."""


_impl: HoldPoints | None = None
# Test hook: extra static approval checks (tool, params, run) -> bool.
_approval_checks: list[Any] = []


def install(impl: HoldPoints) -> None:
    global _impl
    _impl = impl


def register_approval_check(check: Any) -> None:
    _approval_checks.append(check)


def needs_approval(tool: Any, params: dict[str, Any], run: Any) -> bool:
    if tool.needs_approval(params) or any(check(tool, params, run) for check in _approval_checks):
        return True
    return _impl is not None and _impl.needs_approval(tool, params, run)


def hold(action: Action, run: Any, actor: str) -> None:
    if _impl is not None:
        _impl.hold(action, run, actor)


def dispatch_gate(action: Action, actor: str) -> str | None:
    return _impl.check_dispatch(action, actor) if _impl is not None else None


def may_hold(action: Action) -> bool:
    """Could a hold point apply at dispatch? False lets the ledger skip the full re-check
    (which would return None). Conservative: an implementation without the cheap question
    always gets the full one."""
    if _impl is None:
        return False  # nothing is installed to hold it: dispatch_gate lets everything go
    check = getattr(_impl, "may_hold", None)
    return True if check is None else bool(check(action))


def withdrawn(action_ids: list[str], reason: str, actor: str) -> None:
    if _impl is not None and action_ids:
        _impl.withdrawn(action_ids, reason, actor)


def sweep() -> int:
    return _impl.sweep() if _impl is not None else 0
