"""On PostgreSQL, a statement-level trigger wakes dispensers when calls are inserted."""
from typing import Any

from django.db import migrations

CREATE = """
CREATE OR REPLACE FUNCTION dispatcher_wake() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('dispatcher_wake', '');
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;
CREATE TRIGGER dispatcher_call_wake AFTER INSERT ON dispatcher_call
    FOR EACH STATEMENT EXECUTE FUNCTION dispatcher_wake();
"""
DROP = """
DROP TRIGGER IF EXISTS dispatcher_call_wake ON dispatcher_call;
DROP FUNCTION IF EXISTS dispatcher_wake();
"""


def forwards(apps: Any, schema_editor: Any) -> None:
    # NOTIFY is delivered at commit, so a send() inside a rolled-back transaction wakes nobody.
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def backwards(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [("dispatcher", "0001_initial")]
    operations = [migrations.RunPython(forwards, backwards)]
