"""The two human acts of a soak: a reviewer who approves hold points at once, and an
operator who settles unknown outcomes by looking in the tracker.

Everything else in a chaos run moves by itself; these are the only rows the driver moves,
and it moves them through the same functions a reviewer's page calls (`decide`, `resolve`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
from django.utils import timezone

from approvals.decisions import decide
from approvals.models import ApprovalRequest, ApprovalStatus
from approvals.policies import deciders
from chaos.config import HUMAN
from runtime.errors import HoldpointError, InvalidTransition
from runtime.models import Action, ActionStatus, RunStatus
from runtime.outcomes import resolve


class Humans:
    """What the humans did, counted for the report."""

    def __init__(
        self, note: Callable[..., None], fetch_tasks: Callable[[], list[dict[str, Any]]]
    ) -> None:
        self.note = note
        self.fetch_tasks = fetch_tasks
        self.resolutions: Counter[str] = Counter()
        self.approvals: Counter[str] = Counter()
        self.no_reviewer: set[Any] = set()

    def play_reviewer(self, run_ids: list[str]) -> int:
        """Approve every pending approval request of our runs, as a reviewer who watches the
        inbox would: at once, possibly before the run has even parked. Returns how many.

        Through approvals' own `decide`, as the reviewer page calls it. The reviewer is the first
        member allowed to decide under the request's policy who has not voted yet; with
        nobody allowed, the run stays waiting and is reported so.
        """
        pending = ApprovalRequest.objects.filter(
            run_id__in=run_ids, status=ApprovalStatus.PENDING
        ).select_related("policy")
        acted = 0
        for request in pending:
            voted = set(request.votes.values_list("user_id", flat=True))
            allowed = deciders(request.policy, escalated=request.escalated)
            users = [user for user in allowed if user.pk not in voted]
            if not users:
                if request.policy_id not in self.no_reviewer:
                    self.no_reviewer.add(request.policy_id)
                    self.note("no_reviewer", policy=request.policy.name, run_id=request.run_id)
                continue
            try:
                decide(
                    request.pk,
                    users[0],
                    "approve",
                    request.action_hash,
                    reason="chaos: approved as a reviewer would",
                )
            except HoldpointError as exc:  # decided, superseded or expired meanwhile
                self.approvals[f"refused:{exc.code}"] += 1
                self.note("approval_refused", run_id=str(request.run_id), code=exc.code)
                continue
            acted += 1
            self.approvals["approved"] += 1
            self.note(
                "approved",
                run_id=str(request.run_id),
                action_id=str(request.action_id),
                reviewer=users[0].get_username(),
            )
        return acted

    def play_human(self, run_ids: list[str]) -> int:
        """Resolve manual_review actions as a reviewer would, by looking in the tracker.

        "Not applied" only once the sender's in-flight window had passed *before* we looked:
        a request still in flight could land after an empty answer.
        """
        waiting = Action.objects.filter(
            run_id__in=run_ids,
            run__status=RunStatus.NEEDS_RECONCILIATION,
            status=ActionStatus.MANUAL_REVIEW,
        )
        actions = list(waiting)
        if not actions:
            return 0
        looked_at = timezone.now()
        try:
            tasks = self.fetch_tasks()
        except httpx.HTTPError as exc:
            self.note("human_lookup_failed", error=str(exc))
            return 0
        acted = 0
        by_key: dict[str, list[dict[str, Any]]] = {}
        for task in tasks:
            by_key.setdefault(str(task.get("idempotency_key")), []).append(task)
        for action in actions:
            found = by_key.get(action.idempotency_key, [])
            try:
                if found:
                    resolve(
                        action,
                        "applied",
                        actor=HUMAN,
                        external_id=str(found[0]["id"]),
                        note="chaos: the task exists in the tracker",
                    )
                    outcome = "applied"
                elif action.in_flight_until is None or action.in_flight_until <= looked_at:
                    resolve(
                        action,
                        "not_applied",
                        actor=HUMAN,
                        note="chaos: no task with this key, sender no longer in flight",
                    )
                    outcome = "not_applied"
                else:
                    continue
            except InvalidTransition as exc:  # moved meanwhile, or still in flight
                self.note("human_refused", action_id=str(action.action_id), detail=str(exc))
                continue
            acted += 1
            self.resolutions[outcome] += 1
            self.note(
                "human_resolved",
                run_id=str(action.run_id),
                action_id=str(action.action_id),
                outcome=outcome,
                tasks=len(found),
            )
        return acted

    # --- the service ------------------------------------------------------------------------
