"""The dispenser's scan takes equal priorities earliest ``run_at`` first (as Django Tasks takes them by
``run_after``): its partial index of waiting calls gains ``run_at`` so the claim still reads it in order."""
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("dispatcher", "0012_fair_shares"),
    ]

    operations = [
        migrations.RemoveIndex(model_name="callqueue", name="dispatcher_call_waiting_idx"),
        migrations.AddIndex(
            model_name="callqueue",
            index=models.Index(
                condition=models.Q(("status", "pending")), fields=["key_set", "-priority", "run_at", "id"],
                name="dispatcher_call_waiting_idx",
            ),
        ),
    ]
