"""Who shaped a run (separation of duties, issue 16 M1), and the rows for runs in flight.

Runs that can still get a decision (not completed, failed or cancelled) get their shapers
from what was already recorded: the starter from `Run.created_by`, goal revisions and input
from the run's journal stream (`goal_revised`, `input_received`, with the entry's actor and
time). Finished runs get none: nothing is decided on them any more. Going back drops the
table.
"""

import django.db.models.deletion
from django.db import migrations, models

FINISHED = ["completed", "failed", "cancelled"]
KINDS = {"goal_revised": "revised", "input_received": "input"}


def backfill(apps, schema_editor):
    Run = apps.get_model("runtime", "Run")
    RunShaper = apps.get_model("runtime", "RunShaper")
    JournalEntry = apps.get_model("audit", "JournalEntry")
    runs = Run.objects.exclude(status__in=FINISHED).values_list(
        "run_id", "tenant_id", "created_by", "created_at"
    )
    for run_id, tenant_id, created_by, created_at in runs.iterator():
        rows = [
            RunShaper(
                tenant_id=tenant_id,
                run_id=run_id,
                actor=created_by,
                kind="started",
                goal_rev=1,
                created_at=created_at,
            )
        ]
        entries = JournalEntry.objects.filter(stream=f"run:{run_id}", type__in=list(KINDS))
        goal_rev = 1
        for type_, actor, payload, at in entries.order_by("seq").values_list(
            "type", "actor", "payload", "created_at"
        ):
            if type_ == "goal_revised" and isinstance(payload, dict):
                goal_rev = int(payload.get("to_rev") or goal_rev + 1)
            rows.append(
                RunShaper(
                    tenant_id=tenant_id,
                    run_id=run_id,
                    actor=actor[:200],
                    kind=KINDS[type_],
                    goal_rev=goal_rev,
                    created_at=at,
                )
            )
        RunShaper.objects.bulk_create(rows)


class Migration(migrations.Migration):
    dependencies = [
        ("runtime", "0016_revoke_human_tokens"),
        ("audit", "0004_verify_schedule"),
    ]

    operations = [
        migrations.CreateModel(
            name="RunShaper",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("actor", models.CharField(max_length=200)),
                (
                    "kind",
                    models.CharField(
                        choices=[
                            ("started", "Started"),
                            ("revised", "Revised"),
                            ("input", "Input"),
                        ],
                        max_length=8,
                    ),
                ),
                ("goal_rev", models.PositiveIntegerField()),
                ("created_at", models.DateTimeField()),
                (
                    "run",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="shapers",
                        to="runtime.run",
                    ),
                ),
                (
                    "tenant",
                    models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="+",
                        to="runtime.tenant",
                    ),
                ),
            ],
            options={
                "ordering": ["created_at", "id"],
                "constraints": [
                    models.CheckConstraint(
                        condition=models.Q(("kind__in", ["started", "revised", "input"])),
                        name="runtime_runshaper_kind",
                    )
                ],
            },
        ),
        migrations.RunPython(backfill, migrations.RunPython.noop),
    ]
