"""Who shaped a run: the people and agents whose words the run's actions come from.

Separation of duties (issue 16 M1) asks, at every decision, whether the reviewer started
the run, revised its goal, or gave it input since the last decision: such a person shaped
the action and must not be the one who approves it. The answer is a table written where
those three things happen (`runtime.shapers.record_shaper`, called by `create_run`,
`revise_goal` and `provide_input` in their own transactions), not inferred from the
journal at decision time: the journal is per-run history for people to read, and a decision
must not depend on parsing payloads.
"""

from __future__ import annotations

from django.db import models

from runtime.models.runs import Run
from runtime.models.tenancy import Tenant


class ShaperKind(models.TextChoices):
    STARTED = "started"
    REVISED = "revised"
    INPUT = "input"


class RunShaper(models.Model):
    # Reached through the run (its index); the tenant is a check, not a key.
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="+", db_index=False)
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="shapers")
    # The actor label of the writer (`user:alice`, `agent:bot`): what decisions compare.
    actor = models.CharField(max_length=200)
    kind = models.CharField(max_length=8, choices=ShaperKind.choices)
    # The goal revision in force after this act (the new one, for a revision).
    goal_rev = models.PositiveIntegerField()
    # Database time, like an approval's `decided_at`: "since the last decision" compares
    # the two, so both come from the same clock.
    created_at = models.DateTimeField()

    class Meta:
        ordering = ["created_at", "id"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(kind__in=ShaperKind.values), name="runtime_runshaper_kind"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.actor} {self.kind} {self.run_id}"
