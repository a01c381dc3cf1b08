"""Register the sweeper with django-q2's scheduler (once a minute; it ticks within)."""

from django.db import migrations


def add_schedule(apps, schema_editor):
    Schedule = apps.get_model("django_q", "Schedule")
    Schedule.objects.update_or_create(
        name="holdpoint-sweeper",
        defaults={"func": "runtime.tasks.sweep", "schedule_type": "I", "minutes": 1, "repeats": -1},
    )


def remove_schedule(apps, schema_editor):
    apps.get_model("django_q", "Schedule").objects.filter(name="holdpoint-sweeper").delete()


class Migration(migrations.Migration):
    dependencies = [
        ("runtime", "0002_runs"),
        ("django_q", "__latest__"),
    ]
    operations = [migrations.RunPython(add_schedule, remove_schedule)]
