"""The audit log's indexes ascending in id (issue 22): read backwards they serve the same
newest-first pages, and a new entry lands at the end of its group, so page splits leave full
pages behind instead of two half-empty ones (about half of each index's bytes per entry on
PostgreSQL). And by_object holds only the entries about something other than their own
stream: a run's own events — every step of every run — are read through (stream, seq)
instead (runtime.pages.audit.filtered). A big journal rebuilds four indexes here: plan the
migration for a quiet hour."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("audit", "0006_notify_appends"),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name="journalentry",
            name="audit_journal_tenant_recent",
        ),
        migrations.RemoveIndex(
            model_name="journalentry",
            name="audit_journal_by_type",
        ),
        migrations.RemoveIndex(
            model_name="journalentry",
            name="audit_journal_by_actor",
        ),
        migrations.RemoveIndex(
            model_name="journalentry",
            name="audit_journal_by_object",
        ),
        migrations.AddIndex(
            model_name="journalentry",
            index=models.Index(fields=["tenant_id", "id"], name="audit_journal_tenant_recent"),
        ),
        migrations.AddIndex(
            model_name="journalentry",
            index=models.Index(fields=["tenant_id", "type", "id"], name="audit_journal_by_type"),
        ),
        migrations.AddIndex(
            model_name="journalentry",
            index=models.Index(fields=["tenant_id", "actor", "id"], name="audit_journal_by_actor"),
        ),
        migrations.AddIndex(
            model_name="journalentry",
            index=models.Index(
                condition=models.Q(("object_ref", models.F("stream")), _negated=True),
                fields=["tenant_id", "object_ref", "id"],
                name="audit_journal_by_object",
            ),
        ),
    ]
