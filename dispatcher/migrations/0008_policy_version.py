"""On PostgreSQL, a version of the policies that every edit of them bumps, so a worker may keep
the policies it read and check, at each start, that they are still the database's.

Everything ``limiter.Policies.load`` reads moves the version: policies (settings, admin, command,
delete), learnt limits, and pattern pauses (the ``KeyState`` rows of keys ending in ``*``). Each
bump takes a new number from a sequence: the row's new version is seen only once the edit
commits, and no number comes back, not even after a rolled-back edit (a sequence does not roll
back), nor for two edits in one transaction. The table has no model, so a flush of the test
database (TRUNCATE, which fires the triggers of the tables it empties) keeps its row.
"""
from typing import Any

from django.db import migrations

CREATE = """
CREATE SEQUENCE dispatcher_policy_version_seq;
CREATE TABLE dispatcher_policy_version (id integer PRIMARY KEY, version bigint NOT NULL);
INSERT INTO dispatcher_policy_version (id, version) VALUES (1, 0);
CREATE OR REPLACE FUNCTION dispatcher_policy_bump() RETURNS trigger AS $$
BEGIN
    UPDATE dispatcher_policy_version SET version = nextval('dispatcher_policy_version_seq') WHERE id = 1;
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;
CREATE TRIGGER dispatcher_ratelimit_bump AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON dispatcher_ratelimit
    FOR EACH STATEMENT EXECUTE FUNCTION dispatcher_policy_bump();
CREATE TRIGGER dispatcher_learntlimit_bump AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON dispatcher_learntlimit
    FOR EACH STATEMENT EXECUTE FUNCTION dispatcher_policy_bump();
CREATE TRIGGER dispatcher_keystate_pattern_bump AFTER INSERT OR UPDATE ON dispatcher_keystate
    FOR EACH ROW WHEN (right(NEW.key, 1) = '*') EXECUTE FUNCTION dispatcher_policy_bump();
CREATE TRIGGER dispatcher_keystate_pattern_gone AFTER DELETE ON dispatcher_keystate
    FOR EACH ROW WHEN (right(OLD.key, 1) = '*') EXECUTE FUNCTION dispatcher_policy_bump();
CREATE TRIGGER dispatcher_keystate_truncate_bump AFTER TRUNCATE ON dispatcher_keystate
    FOR EACH STATEMENT EXECUTE FUNCTION dispatcher_policy_bump();
"""
DROP = """
DROP TRIGGER IF EXISTS dispatcher_ratelimit_bump ON dispatcher_ratelimit;
DROP TRIGGER IF EXISTS dispatcher_learntlimit_bump ON dispatcher_learntlimit;
DROP TRIGGER IF EXISTS dispatcher_keystate_pattern_bump ON dispatcher_keystate;
DROP TRIGGER IF EXISTS dispatcher_keystate_pattern_gone ON dispatcher_keystate;
DROP TRIGGER IF EXISTS dispatcher_keystate_truncate_bump ON dispatcher_keystate;
DROP FUNCTION IF EXISTS dispatcher_policy_bump();
DROP TABLE IF EXISTS dispatcher_policy_version;
DROP SEQUENCE IF EXISTS dispatcher_policy_version_seq;
"""


def forwards(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def backwards(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [("dispatcher", "0007_keystate_running_derived")]
    operations = [migrations.RunPython(forwards, backwards)]
