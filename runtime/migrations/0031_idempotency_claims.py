# An Idempotency-Key whose request died (SIGKILL, a lost database connection, a 5xx) stayed
# "in flight" for HOLDPOINT_IDEMPOTENCY_HOURS: the claim now has a lease and a fence, and
# the effect is recorded with it in the effect's own transaction (runtime.api.idempotency).

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("runtime", "0030_standalone_send_failures"),
    ]

    operations = [
        migrations.AddField(
            model_name="idempotencyrecord",
            name="claim",
            field=models.PositiveIntegerField(default=1),
        ),
        migrations.AddField(
            model_name="idempotencyrecord",
            name="claimed_until",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="idempotencyrecord",
            name="effect",
            field=models.CharField(blank=True, default="", max_length=64),
        ),
        migrations.AddField(
            model_name="idempotencyrecord",
            name="effect_created",
            field=models.BooleanField(default=True),
        ),
    ]
