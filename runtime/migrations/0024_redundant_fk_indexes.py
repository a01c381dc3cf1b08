"""Two foreign keys' own indexes dropped (issue 22): each is the first column of a unique
index already there — checkpoint.run of runtime_checkpoint_one_rev (run_id, rev), and
artifact.tenant of runtime_artifact_once (tenant_id, digest) — which serves every lookup,
cascade and protect check the single-column index did. An index fewer is one page fewer
written by every step's commit (and its bytes).

Dropped by name, not by AlterField: Django's SQLite schema editor would rebuild both tables
(copy every row) to drop an index. The names are Django's for these fields on both vendors.
"""

import django.db.models.deletion
from django.db import migrations, models

INDEXES = {
    "runtime_checkpoint_run_id_d35950d6": ("runtime_checkpoint", "run_id"),
    "runtime_artifact_tenant_id_01e8a515": ("runtime_artifact", "tenant_id"),
}


class Migration(migrations.Migration):
    dependencies = [
        ("runtime", "0023_run_trace_context"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(
                    f'DROP INDEX IF EXISTS "{name}"',
                    reverse_sql=f'CREATE INDEX "{name}" ON "{table}" ("{column}")',
                )
                for name, (table, column) in INDEXES.items()
            ],
            state_operations=[
                migrations.AlterField(
                    model_name="artifact",
                    name="tenant",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.PROTECT,
                        to="runtime.tenant",
                    ),
                ),
                migrations.AlterField(
                    model_name="checkpoint",
                    name="run",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="checkpoints",
                        to="runtime.run",
                    ),
                ),
            ],
        ),
    ]
