"""PostgreSQL refuses UPDATE and DELETE of history unless the purge opened its gate.

The gate is a row in audit_purgegate inserted inside the purge's own transaction: no other
transaction can see it, so no other path can change history. (SQLite, the embedded mode, is
protected by the models alone: its test flush deletes rows, which a trigger would refuse.)
TRUNCATE is left to grants: the production role is not granted it.
"""

from django.db import migrations

FUNCTION = """
CREATE OR REPLACE FUNCTION holdpoint_append_only() RETURNS trigger AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM audit_purgegate) THEN
        RETURN COALESCE(NEW, OLD);
    END IF;
    RAISE EXCEPTION 'append-only: % of % refused', TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'insufficient_privilege';
END
$$ LANGUAGE plpgsql;
"""
TRIGGER = """
CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table}
FOR EACH ROW EXECUTE FUNCTION holdpoint_append_only();
"""


def install(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(FUNCTION, params=None)
    schema_editor.execute(TRIGGER.format(table="audit_journalentry"))


def uninstall(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(
        "DROP TRIGGER IF EXISTS audit_journalentry_append_only ON audit_journalentry"
    )


class Migration(migrations.Migration):
    dependencies = [("audit", "0002_append_only")]
    operations = [migrations.RunPython(install, uninstall)]
