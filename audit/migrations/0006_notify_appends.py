"""PostgreSQL tells listeners when a stream moves: the live event streams (runtime.live).

A trigger on the stream head, not a statement in audit.journal: every writer moves the head
(`append`, `write`, the one-statement `append_after`), so each is covered with no change to
the hot path and no extra round trip. NOTIFY is transactional — delivered at commit, never
for a rollback — and PostgreSQL folds identical notifications of one transaction into one.
The payload is small on purpose ("<tenant_id> <stream>"): listeners re-read the journal
(`seq > last`), so a notification is a doorbell, never the data. SQLite polls instead.
"""

from django.db import migrations

CHANNEL = "holdpoint_journal"
FUNCTION = f"""
CREATE OR REPLACE FUNCTION holdpoint_notify_append() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('{CHANNEL}', NEW.tenant_id || ' ' || NEW.stream);
    RETURN NULL;
END
$$ LANGUAGE plpgsql;
"""
TRIGGER = """
CREATE TRIGGER audit_streamhead_notify AFTER UPDATE OF seq ON audit_streamhead
FOR EACH ROW EXECUTE FUNCTION holdpoint_notify_append();
"""


def install(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(FUNCTION, params=None)
    schema_editor.execute(TRIGGER)


def uninstall(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute("DROP TRIGGER IF EXISTS audit_streamhead_notify ON audit_streamhead")
    schema_editor.execute("DROP FUNCTION IF EXISTS holdpoint_notify_append()")


class Migration(migrations.Migration):
    dependencies = [("audit", "0005_admin_names")]
    operations = [migrations.RunPython(install, uninstall)]
