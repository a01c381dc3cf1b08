"""The one narrow function through which the executor consults hold points.

`runtime` knows nothing of `approvals` (DESIGN.md layering). The approvals app registers its
checks here at start-up; with none registered, only the tool's own static declaration counts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from runtime.models import Action

# (tool, params, run) -> whether this action needs a human decision before it may be sent.
_approval_checks: list[Callable[[Any, dict[str, Any], Any], bool]] = []
# (action) -> raises if the action may not be sent now (approval missing, stale, expired…).
_dispatch_checks: list[Callable[[Action], None]] = []


def register_approval_check(check: Callable[[Any, dict[str, Any], Any], bool]) -> None:
    _approval_checks.append(check)


def register_dispatch_check(check: Callable[[Action], None]) -> None:
    _dispatch_checks.append(check)


def needs_approval(tool: Any, params: dict[str, Any], run: Any) -> bool:
    return tool.needs_approval(params) or any(
        check(tool, params, run) for check in _approval_checks
    )


def dispatch_gate(action: Action) -> None:
    """Called inside the transaction that marks the action sent, with its row locked."""
    for check in _dispatch_checks:
        check(action)
