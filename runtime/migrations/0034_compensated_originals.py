"""Mend the originals whose undo was confirmed while they stayed `confirmed`.

An undo's confirmation and its original's move to `compensated` were two commits, and only
the undo's sender wrote the second: a sender killed between them, a reconciliation, or a
person's resolution of the undo left the original `confirmed` under a `confirmed` undo, and
nothing would ever look at it again. Both are now one commit (`ledger.transition`); this
moves the originals left so by older code to `compensated` — a compare-and-swap on their
still being `confirmed` — and journals each in its run's stream as the ledger does (an
`action_outcome`, naming its undo), with the app's own `audit.journal.append` so that the
chain is the one verification recomputes. On a database with none it writes nothing.
"""

from django.db import migrations
from django.db.models import Exists, OuterRef
from django.db.models.functions import Now

ACTOR = "system:migration runtime.0034"


def mend(apps, schema_editor):
    from audit import journal

    Action = apps.get_model("runtime", "Action")
    undone = Action.objects.filter(compensates=OuterRef("pk"), status="confirmed")
    stuck = Action.objects.filter(Exists(undone), status="confirmed").order_by("created_at")
    for original in stuck:
        undo = Action.objects.filter(compensates=original, status="confirmed").first()
        if undo is None:
            continue
        moved = Action.objects.filter(pk=original.pk, status="confirmed").update(
            status="compensated", updated_at=Now()
        )
        if not moved:
            continue
        stream = journal.run_stream(original.run_id)
        journal.append(
            stream,
            "action_outcome",
            tenant_id=original.tenant_id,
            actor=ACTOR,
            object_ref=stream,
            payload={
                "action_id": str(original.action_id),
                "idempotency_key": original.idempotency_key,
                "fingerprint": original.fingerprint,
                "action_status": "compensated",
                "compensated_by": str(undo.action_id),
            },
        )


class Migration(migrations.Migration):
    dependencies = [
        ("runtime", "0033_checkpoint_base_manager"),
        ("audit", "0008_append_only_gate_by_schema"),
    ]

    operations = [migrations.RunPython(mend, migrations.RunPython.noop)]
