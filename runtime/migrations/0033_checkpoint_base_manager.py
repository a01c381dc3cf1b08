"""Checkpoints' base manager is their append-only queryset (no SQL: a model option).

Django deletes the rows that go with a deleted run through each related model's base
manager; with the plain one a run deleted outside the retention purge took its checkpoints
with it on SQLite, where no trigger guards them (runtime.models.Checkpoint).
"""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("runtime", "0032_idempotency_principal"),
    ]

    operations = [
        migrations.AlterModelOptions(
            name="checkpoint",
            options={"base_manager_name": "objects", "ordering": ["run", "rev"]},
        ),
    ]
