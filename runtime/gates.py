"""The one narrow interface through which the runtime consults hold points.

`runtime` knows nothing of `approvals` (DESIGN.md layering). The approvals app registers a
`HoldPoints` implementation at start-up; without one, only a tool's own static declaration
counts and nothing can approve (actions needing approval simply wait).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from django.db.models import QuerySet

from fastsql import statements
from runtime.models import Action, Run


@dataclass(frozen=True)
class Verdict:
    """The hold point's answer at dispatch: the re-check only reads, the ledger acts on it.

    `refusal` empty: the action may be sent. Otherwise it is the error code the sender gets
    (`approval_required`, `approval_expired`), the action goes back to awaiting approval,
    and `stale` names the approval that no longer binds it (to supersede), if there was one.
    `reason` says in words why that approval stopped counting and what follows — what the
    journal and reviewers read (the code is for the sender). `withdraw`, when set: nothing
    is asked again — the hold point's policy ends the action there (it rejects at expiry),
    and the ledger cancels it with these words as its last error.
    """

    refusal: str = ""
    stale: Any = None
    reason: str = ""
    withdraw: str = ""

    @property
    def go(self) -> bool:
        return not self.refusal


GO = Verdict()


class HoldPoints(Protocol):
    def needs_approval(self, tool: Any, params: dict[str, Any], run: Any, target: str = "") -> bool:
        """Whether this action must wait for a human decision before it may be sent (at
        prepare: a policy conditioned on the target must hold it here, not only at dispatch)."""

    def unheld_part(
        self, one: statements.OneStatement, tenant_id: int, tool: str, after: str
    ) -> statements.Part | None:
        """Optional. A guard part of a one-statement prepare (PostgreSQL), after the part
        `after`: it yields a row only while none of the implementation's hold points can apply
        to an action of `tool` in the tenant, whatever its params or target — read in the
        statement's own snapshot, after its compare-and-swap locked the run row. None (or no
        such method): it cannot say so in one part, and the prepare asks `needs_approval`
        inside a transaction instead."""

    def hold(self, action: Action, run: Any, actor: str) -> None:
        """The action waits (awaiting_approval): make sure an open request exists for it.
        Called inside the transaction that prepared (or re-held) the action."""

    def check_dispatch(self, action: Action) -> Verdict:
        """Inside the transaction that would mark the action sent (its row locked): whether
        it may go, else why not and which approval no longer binds. Writes nothing."""

    def supersede(self, approval: Any, action: Action, reason: str, actor: str) -> None:
        """The approval a verdict named stale stops counting (a compare-and-swap on its
        approved state, journaled); called by the ledger in the same transaction."""

    def may_hold(self, action: Action, tool: Any) -> bool:
        """Inside the dispatch transaction (the run row locked), cheaply: False only when no
        hold point can apply to the action — no request for it, no policy for its tool, no
        approval declared by `tool` (the action's tool at its version) — so
        `check_dispatch` would certainly say go."""

    def withdrawn(self, action_ids: list[str], reason: str, actor: str) -> None:
        """Actions were cancelled unsent (goal revised, run cancelled, an external run
        finished): close their requests, open or approved — none of them approves anything
        now."""

    def tools_named(self, tenant_id: int) -> set[str]:
        """Names of tools an active policy of the tenant names: for those the policy
        decides; any other tool that changes something waits for a reviewer by default."""

    def sweep(self) -> int:
        """Periodic work (expiry, reminders, escalation); returns how much was done."""

    def purgeable(self, runs: QuerySet[Run]) -> QuerySet[Run]:
        """`runs` without those a hold point still needs (an open request): retention may
        remove the rest, and their requests go with them (they cascade from the run)."""


_impl: HoldPoints | None = None
# Test hook: extra static approval checks (tool, params, run) -> bool.
_approval_checks: list[Any] = []


def install(impl: HoldPoints) -> None:
    global _impl
    _impl = impl


def register_approval_check(check: Any) -> None:
    _approval_checks.append(check)


def needs_approval(tool: Any, params: dict[str, Any], run: Any, target: str = "") -> bool:
    if tool.needs_approval(params) or any(check(tool, params, run) for check in _approval_checks):
        return True
    return _impl is not None and _impl.needs_approval(tool, params, run, target)


def unheld_parts(
    one: statements.OneStatement, tool: Any, params: dict[str, Any], run: Any, after: str
) -> list[statements.Part] | None:
    """The guard of a prepare written as one statement (`needs_approval`'s answer "no", as
    parts after the part `after`): [] when nothing is installed to hold it, the
    implementation's guard part otherwise. None when the action may be held in a way one
    statement cannot check — the tool's own rule, a tool held by default, a test hook, an
    implementation without `unheld_part` — and the prepare then takes its transaction."""
    if tool.needs_approval(params) or getattr(tool, "default_hold", False):
        return None
    if any(check(tool, params, run) for check in _approval_checks):
        return None
    if _impl is None:
        return []
    guard = getattr(_impl, "unheld_part", None)
    part = None if guard is None else guard(one, run.tenant_id, tool.name, after)
    return None if part is None else [part]


def hold(action: Action, run: Any, actor: str) -> None:
    if _impl is not None:
        _impl.hold(action, run, actor)


def dispatch_gate(action: Action) -> Verdict:
    return _impl.check_dispatch(action) if _impl is not None else GO


def supersede(approval: Any, action: Action, reason: str, actor: str) -> None:
    if _impl is not None:
        _impl.supersede(approval, action, reason, actor)


def may_hold(action: Action, tool: Any) -> bool:
    """Could a hold point apply at dispatch? False lets the ledger skip the full re-check
    (which would say go). Conservative: an implementation without the cheap question
    always gets the full one."""
    if _impl is None:
        return False  # nothing is installed to hold it: dispatch_gate lets everything go
    check = getattr(_impl, "may_hold", None)
    return True if check is None else bool(check(action, tool))


def withdrawn(action_ids: list[str], reason: str, actor: str) -> None:
    if _impl is not None and action_ids:
        _impl.withdrawn(action_ids, reason, actor)


def tools_named_by_policy(tenant_id: int) -> set[str]:
    """What `HoldPoints.tools_named` says (nothing without an implementation that knows)."""
    named = getattr(_impl, "tools_named", None)
    return set(named(tenant_id)) if named is not None else set()


def sweep() -> int:
    return _impl.sweep() if _impl is not None else 0


def purgeable(runs: QuerySet[Run]) -> QuerySet[Run]:
    return _impl.purgeable(runs) if _impl is not None else runs
