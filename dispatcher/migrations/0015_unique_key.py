"""Send once: a call's unique key, how long it holds it (``unique_until``), and a partial unique index on
the calls that hold theirs. Existing rows keep their data and hold no key; the new columns are
nullable or have a constant default (no table rewrite on PostgreSQL), and the index covers only
rows with a key, so it is built at once."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('dispatcher', '0014_key_weight'),
    ]

    operations = [
        migrations.AddField(
            model_name='callqueue',
            name='unique_key',
            field=models.CharField(blank=True, help_text='While this call holds it, a send with this key returns this call.', max_length=255, null=True),
        ),
        migrations.AddField(
            model_name='callqueue',
            name='unique_released',
            field=models.BooleanField(db_default=False, default=False, help_text='The key was let go: the call finished and its unique_until passed, and another send took the key.'),
        ),
        migrations.AddField(
            model_name='callqueue',
            name='unique_until',
            field=models.DateTimeField(blank=True, help_text="The call holds its unique key until then, even finished (send's unique_for).", null=True),
        ),
        migrations.AddConstraint(
            model_name='callqueue',
            constraint=models.UniqueConstraint(condition=models.Q(('unique_key__isnull', False), ('unique_released', False)), fields=('unique_key',), name='dispatcher_call_unique_key_held'),
        ),
    ]
