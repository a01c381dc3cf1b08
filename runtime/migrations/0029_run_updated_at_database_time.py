# A run's updated_at on insert is the database's clock (a default the INSERT returns), as every
# later write of it already was (Now()); auto_now stamped the inserting process's clock.

import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("runtime", "0028_tally"),
    ]

    operations = [
        migrations.AlterField(
            model_name="run",
            name="updated_at",
            field=models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
        ),
    ]
