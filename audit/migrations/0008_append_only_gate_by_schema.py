"""The append-only trigger asks the real purge gate, never a temporary table of its name.

0003's function read `audit_purgegate` by its bare name, and PostgreSQL looks a bare table
name up in the session's temporary schema first (pg_temp is searched before the path unless
the path lists it). Any role allowed temporary tables — every role, by default — could
create one named so, put a row in it, and update or delete history with no grant on the
gate. The function now runs with its search path fixed to the schema its tables were
migrated into, pg_temp listed last: a bare name finds the real gate. Fixed on the function
(`ALTER FUNCTION … SET`), the plan stays static: the purge's per-row cost is unchanged.
"""

from django.db import migrations


def install(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("SELECT current_schema()")
        (schema,) = cursor.fetchone()
    quoted = schema_editor.connection.ops.quote_name(schema)
    schema_editor.execute(
        f"ALTER FUNCTION holdpoint_append_only() SET search_path = {quoted}, pg_temp",
        params=None,
    )


def uninstall(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute("ALTER FUNCTION holdpoint_append_only() RESET search_path", params=None)


class Migration(migrations.Migration):
    dependencies = [("audit", "0007_journal_indexes_ascending")]
    operations = [migrations.RunPython(install, uninstall)]
