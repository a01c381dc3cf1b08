"""API tokens are for agent accounts only (issue 15, part 5): revoke every unrevoked token
of a person — a user who is not an agent account of the token's tenant — and journal each
revocation in the tenant's stream, as `revoke_token` does. Authentication refuses such
tokens anyway (runtime/models/tokens.py); this makes the admin and `agent_token list` say so.

The journal is written with the app's own `audit.journal.append` (the chain must be the one
verification recomputes); on a new database there are no tokens and it is never called.
"""

from django.db import migrations
from django.db.models import Exists, OuterRef
from django.utils import timezone

ACTOR = "system:migration runtime.0016"


def revoke(apps, schema_editor):
    from audit import journal

    AgentToken = apps.get_model("runtime", "AgentToken")
    Membership = apps.get_model("runtime", "Membership")
    agent = Membership.objects.filter(
        user=OuterRef("user"), tenant=OuterRef("tenant"), role="agent"
    )
    now = timezone.now()
    people = (
        AgentToken.objects.filter(revoked_at__isnull=True)
        .exclude(Exists(agent))
        .select_related("user")
        .order_by("pk")
    )
    for token in people:
        if not AgentToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(
            revoked_at=now
        ):
            continue
        journal.append(
            journal.tenant_stream(token.tenant_id),
            "token_revoked",
            tenant_id=token.tenant_id,
            actor=ACTOR,
            payload={
                "agent": token.user.username,
                "token_prefix": token.prefix,
                "name": token.name,
                "expires_at": token.expires_at.isoformat() if token.expires_at else None,
                "reason": "API tokens are for agent accounts only",
            },
        )


class Migration(migrations.Migration):
    dependencies = [
        ("runtime", "0015_failed_login_windows"),
        ("audit", "0004_verify_schedule"),
    ]
    operations = [migrations.RunPython(revoke, migrations.RunPython.noop)]
