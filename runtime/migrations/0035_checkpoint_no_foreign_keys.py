"""A checkpoint's foreign keys are checked by its writer, not by the database (issue 22).

A checkpoint is inserted only by the statement (or transaction) whose compare-and-swap on its
run's row wrote — `stepcommit`: `INSERT … SELECT … FROM changed`, or `update_then_insert` —
and with that run's tenant, so both keys are proved by the same statement that writes the
row. PostgreSQL's deferred checks of them, run again at every step's commit, cost about 5% of
the server's CPU per step (measured, bench/HISTORY.md), and the tenant's check takes a
`FOR KEY SHARE` lock on the tenant's row: every step of every run of a tenant locks that one
row, which becomes a multixact as soon as two workers commit at once. The tenant's own index
goes too: nothing looks checkpoints up by tenant alone (retention reaches them through the
tenant's runs), and it was one more index page written per step.

What the keys guarded is still checked: `manage.py checkpoint_verify` names a checkpoint
whose run is gone or whose tenant is not its run's (runtime.checkverify).

SQLite: the index is dropped by name; the keys stay in the table's definition (dropping them
means copying the table), where they cost little and say the same.
"""

from django.db import migrations, models

RUN_FK = "runtime_checkpoint_run_id_d35950d6_fk_runtime_run_run_id"
TENANT_FK = "runtime_checkpoint_tenant_id_6d234858_fk_runtime_tenant_id"
TENANT_INDEX = "runtime_checkpoint_tenant_id_6d234858"


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for name in (RUN_FK, TENANT_FK):
            schema_editor.execute(
                f'ALTER TABLE "runtime_checkpoint" DROP CONSTRAINT IF EXISTS "{name}"'
            )
    schema_editor.execute(f'DROP INDEX IF EXISTS "{TENANT_INDEX}"')


def restore(apps, schema_editor):
    schema_editor.execute(
        f'CREATE INDEX IF NOT EXISTS "{TENANT_INDEX}" ON "runtime_checkpoint" ("tenant_id")'
    )
    if schema_editor.connection.vendor != "postgresql":
        return
    for name, column, target in (
        (RUN_FK, "run_id", '"runtime_run" ("run_id")'),
        (TENANT_FK, "tenant_id", '"runtime_tenant" ("id")'),
    ):
        schema_editor.execute(
            f'ALTER TABLE "runtime_checkpoint" ADD CONSTRAINT "{name}" FOREIGN KEY ("{column}")'
            f" REFERENCES {target} DEFERRABLE INITIALLY DEFERRED"
        )


class Migration(migrations.Migration):
    dependencies = [("runtime", "0034_compensated_originals")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(drop, restore)],
            state_operations=[
                migrations.AlterField(
                    model_name="checkpoint",
                    name="run",
                    field=models.ForeignKey(
                        db_constraint=False,
                        db_index=False,
                        on_delete=models.deletion.CASCADE,
                        related_name="checkpoints",
                        to="runtime.run",
                    ),
                ),
                migrations.AlterField(
                    model_name="checkpoint",
                    name="tenant",
                    field=models.ForeignKey(
                        db_constraint=False,
                        db_index=False,
                        on_delete=models.deletion.PROTECT,
                        to="runtime.tenant",
                    ),
                ),
            ],
        )
    ]
