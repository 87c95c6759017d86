"""On PostgreSQL, a trigger rejects every UPDATE and DELETE of the audit log.

TRUNCATE is left to the table's owner (test databases are flushed that way); the hash chain
catches anything done with it. SQLite relies on the model, queryset and hash chain.
"""

from django.db import migrations

CREATE = """
CREATE OR REPLACE FUNCTION omni_audit_append_only() RETURNS trigger AS $$
BEGIN
    RAISE EXCEPTION 'the audit log (jobs_elasticevent) is append-only: % rejected', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END;
$$ LANGUAGE plpgsql;
DROP TRIGGER IF EXISTS elasticevent_append_only ON jobs_elasticevent;
CREATE TRIGGER elasticevent_append_only
    BEFORE UPDATE OR DELETE ON jobs_elasticevent
    FOR EACH ROW EXECUTE FUNCTION omni_audit_append_only();
"""

DROP = """
DROP TRIGGER IF EXISTS elasticevent_append_only ON jobs_elasticevent;
DROP FUNCTION IF EXISTS omni_audit_append_only();
"""


def create_trigger(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE, params=None)


def drop_trigger(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP, params=None)


class Migration(migrations.Migration):
    dependencies = [("jobs", "0002_roles")]

    operations = [migrations.RunPython(create_trigger, drop_trigger)]
