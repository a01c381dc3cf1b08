"""Failed logins counted per window (issue 16 L8), and the schedule that journals the count
of each ended window (every 15 minutes)."""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


def add_schedule(apps, schema_editor):
    apps.get_model("django_q", "Schedule").objects.update_or_create(
        name="holdpoint-failed-logins",
        defaults={
            "func": "runtime.tasks.close_failed_logins",
            "schedule_type": "I",
            "minutes": 15,
            "repeats": -1,
        },
    )


def remove_schedule(apps, schema_editor):
    apps.get_model("django_q", "Schedule").objects.filter(name="holdpoint-failed-logins").delete()


class Migration(migrations.Migration):
    dependencies = [
        ("runtime", "0014_run_status_constraints"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
        ("django_q", "__latest__"),
    ]

    operations = [
        migrations.CreateModel(
            name="FailedLoginWindow",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("started_at", models.DateTimeField()),
                ("last_at", models.DateTimeField()),
                ("unrecorded", models.PositiveIntegerField(default=0)),
                ("locked_out", models.BooleanField(default=False)),
                ("ips", models.JSONField(default=list)),
                ("user_agent", models.CharField(blank=True, default="", max_length=200)),
                (
                    "tenant",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="+",
                        to="runtime.tenant",
                    ),
                ),
                (
                    "user",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="+",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
            ],
            options={
                "indexes": [
                    models.Index(fields=["started_at"], name="runtime_failedlogin_started")
                ],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("user", "tenant"), name="runtime_failedloginwindow_one_per_member"
                    )
                ],
            },
        ),
        migrations.RunPython(add_schedule, remove_schedule),
    ]
