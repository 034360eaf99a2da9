"""KeyStart becomes StartLog (its rows are one start each under one key; the old name differed from
KeyState by one letter). The table keeps its name, so no row moves."""
from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("dispatcher", "0010_status_label_waiting")]

    operations = [migrations.RenameModel("KeyStart", "StartLog")]
