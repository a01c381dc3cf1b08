"""Checkpoints are append-only too (invariant 8): the same trigger as the journal's."""

from django.db import migrations


def install(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(
        "CREATE TRIGGER runtime_checkpoint_append_only BEFORE UPDATE OR DELETE "
        "ON runtime_checkpoint FOR EACH ROW EXECUTE FUNCTION holdpoint_append_only();"
    )


def uninstall(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(
        "DROP TRIGGER IF EXISTS runtime_checkpoint_append_only ON runtime_checkpoint"
    )


class Migration(migrations.Migration):
    dependencies = [
        ("runtime", "0006_step_rev"),
        ("audit", "0003_append_only_triggers"),
    ]
    operations = [migrations.RunPython(install, uninstall)]
