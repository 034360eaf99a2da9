"""params and result read through StoredJSONDecoder: a row stored too deeply nested reads as a note.

The decoder lives in Python only; the columns do not change, so the database is left alone
(SQLite would otherwise rebuild the table for an AlterField).
"""
from django.db import migrations, models

import dispatcher.validation


class Migration(migrations.Migration):

    dependencies = [
        ("dispatcher", "0002_wake_trigger"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="callqueue",
                    name="params",
                    field=models.JSONField(blank=True, decoder=dispatcher.validation.StoredJSONDecoder, default=dict),
                ),
                migrations.AlterField(
                    model_name="callqueue",
                    name="result",
                    field=models.JSONField(blank=True, decoder=dispatcher.validation.StoredJSONDecoder, null=True),
                ),
            ],
            database_operations=[],
        ),
    ]
