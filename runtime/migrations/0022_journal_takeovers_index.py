"""A partial index holding only the journal's lease takeovers, for /metrics.

runtime.metrics counts `holdpoint_lease_takeovers_total` with exactly this predicate, so the
count reads this index (as many entries as takeovers ever happened), never the journal. The
predicate is on runtime's event type and payload, so runtime owns the index; the audit app
keeps knowing nothing of run events. Per vendor: the payload is jsonb on PostgreSQL, JSON
text on SQLite.
"""

from django.db import migrations

INDEX = "runtime_journal_takeovers"
PREDICATE = {
    "postgresql": "type = 'lease_taken' AND payload @> '{\"takeover\": true}'",
    "sqlite": "type = 'lease_taken' AND json_extract(payload, '$.takeover') = 1",
}


def create(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    schema_editor.execute(
        f"CREATE INDEX {INDEX} ON audit_journalentry (id) WHERE {PREDICATE[vendor]}"
    )


def drop(apps, schema_editor):
    schema_editor.execute(f"DROP INDEX {INDEX}")


class Migration(migrations.Migration):
    dependencies = [
        ("runtime", "0021_admin_names"),
        ("audit", "0005_admin_names"),
    ]

    operations = [migrations.RunPython(create, drop)]
