# An Idempotency-Key's record names who made the request (runtime.api.idempotency): the same
# key and body from another caller of the tenant was answered with the first caller's stored
# response. Existing records keep a null principal and are replayed as before until
# HOLDPOINT_IDEMPOTENCY_HOURS forgets them: no data migration.

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("runtime", "0031_idempotency_claims"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddField(
            model_name="idempotencyrecord",
            name="principal",
            field=models.ForeignKey(
                blank=True,
                db_index=False,
                null=True,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="+",
                to=settings.AUTH_USER_MODEL,
            ),
        ),
    ]
