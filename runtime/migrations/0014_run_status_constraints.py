"""What a run's status implies, as named CHECK constraints (runtime/models/runs.py says why).

Every writer of these columns already keeps the rules (see each constraint's comment), but a
database that ran older code may hold rows that break them, and adding a CHECK constraint
over such a row fails the whole migration. So a data step first mends exactly those rows:

- a finished run (completed, failed, cancelled) that still names a lease: the lease is
  cleared — nobody may execute a finished run, and no write is conditional on it any more;
- half a lease (an owner without an expiry, or an expiry without an owner): cleared. That
  frees the run for the next executor at once, which is safe because every executor write is
  conditional on the fence, and taking the lease bumps it (DESIGN.md, invariant 4);
- needs_attention with no reason: a reason saying that none was recorded.

These are repairs of bookkeeping, not transitions, so they are not journalled. Going back
removes the constraints and leaves the mended rows as they are.
"""

from django.db import migrations, models

FINISHED = ["completed", "failed", "cancelled"]
NO_REASON = "needs attention (no reason was recorded before migration runtime 0014)"


def mend_rows(apps, schema_editor):
    Run = apps.get_model("runtime", "Run")
    unleased = {"lease_owner": "", "lease_expires_at": None}
    leased = models.Q(lease_expires_at__isnull=False) | ~models.Q(lease_owner="")
    Run.objects.filter(leased, status__in=FINISHED).update(**unleased)
    Run.objects.filter(lease_owner="", lease_expires_at__isnull=False).update(**unleased)
    Run.objects.exclude(lease_owner="").filter(lease_expires_at__isnull=True).update(**unleased)
    Run.objects.filter(status="needs_attention", attention_reason="").update(
        attention_reason=NO_REASON
    )


class Migration(migrations.Migration):
    dependencies = [
        ("runtime", "0013_sweeper_turn"),
    ]

    operations = [
        migrations.RunPython(mend_rows, migrations.RunPython.noop),
        migrations.AddConstraint(
            model_name="run",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    models.Q(("lease_expires_at__isnull", True), ("lease_owner", "")),
                    models.Q(
                        models.Q(("lease_owner", ""), _negated=True),
                        ("lease_expires_at__isnull", False),
                    ),
                    _connector="OR",
                ),
                name="runtime_run_lease_both_or_neither",
            ),
        ),
        migrations.AddConstraint(
            model_name="run",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    models.Q(("status__in", ["completed", "failed", "cancelled"]), _negated=True),
                    models.Q(("lease_expires_at__isnull", True), ("lease_owner", "")),
                    _connector="OR",
                ),
                name="runtime_run_finished_no_lease",
            ),
        ),
        migrations.AddConstraint(
            model_name="run",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    models.Q(("status", "needs_attention"), _negated=True),
                    models.Q(("attention_reason", ""), _negated=True),
                    _connector="OR",
                ),
                name="runtime_run_attention_has_reason",
            ),
        ),
    ]
