"""Verify recently written streams every hour (django-q2 schedule)."""

from django.db import migrations


def add_schedule(apps, schema_editor):
    apps.get_model("django_q", "Schedule").objects.update_or_create(
        name="holdpoint-audit-verify",
        defaults={"func": "audit.tasks.verify_recent_streams", "schedule_type": "H", "repeats": -1},
    )


def remove_schedule(apps, schema_editor):
    apps.get_model("django_q", "Schedule").objects.filter(name="holdpoint-audit-verify").delete()


class Migration(migrations.Migration):
    dependencies = [("audit", "0003_append_only_triggers"), ("django_q", "__latest__")]
    operations = [migrations.RunPython(add_schedule, remove_schedule)]
