"""PostgreSQL: the two SECURITY DEFINER functions through which partitions are created and dropped
(telemetry.partitions, docs/telemetry.md "PostgreSQL: native partitions").

``CREATE TABLE ... PARTITION OF``, ``DETACH PARTITION`` and ``DROP TABLE`` need the parent's
owner and CREATE on the schema, which the restricted application role of ``grant_app_role``
has not (docs/audit-log.md). These functions are owned by the role that runs this migration
(the tables' owner) and do only those three statements, on the six partitioned telemetry tables
and on names of the form ``<parent>_pYYYYMMDD`` with the bounds telemetry.partitions makes;
EXECUTE is revoked from PUBLIC and granted to the application role by ``grant_app_role``.
The names are spelled out here, not imported from app code, so this migration never changes
under it. SQLite has no partitions: no-op.
"""

from django.db import migrations

DAILY = ("telemetry_gpusample", "telemetry_steprecord", "telemetry_gpuminute", "telemetry_stepminute")
MONTHLY = ("telemetry_gpuhour", "telemetry_stephour")

# {home} is the schema as a SQL literal, {schema} as an identifier, {daily}/{monthly} lists of
# literals. The functions run with UTC and a search_path of pg_catalog then pg_temp (a caller's
# temporary table cannot stand in for a catalog), and qualify every table with the schema.
CREATE_PARTITION = """
CREATE FUNCTION {schema}.omni_telemetry_create_partition(parent text, starts timestamptz, ends timestamptz)
RETURNS text LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp SET timezone = 'UTC'
AS $body$
DECLARE
    home constant text := {home};
    partition_name text;
BEGIN
    IF parent IN ({daily}) THEN
        IF starts IS NULL OR starts <> date_trunc('day', starts) OR ends IS DISTINCT FROM starts + interval '1 day' THEN
            RAISE EXCEPTION 'a partition of % spans one day from midnight UTC, not [%, %)', parent, starts, ends
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    ELSIF parent IN ({monthly}) THEN
        IF starts IS NULL OR starts <> date_trunc('month', starts) OR ends IS DISTINCT FROM starts + interval '1 month' THEN
            RAISE EXCEPTION 'a partition of % spans one month from its first day, not [%, %)', parent, starts, ends
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    ELSE
        RAISE EXCEPTION '% is not a partitioned telemetry table', format('%L', parent)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    partition_name := parent || '_p' || to_char(starts, 'YYYYMMDD');
    EXECUTE format('CREATE TABLE IF NOT EXISTS %I.%I PARTITION OF %I.%I FOR VALUES FROM (%L) TO (%L)',
                   home, partition_name, home, parent, starts, ends);
    RETURN partition_name;
END
$body$"""

DROP_PARTITION = """
CREATE FUNCTION {schema}.omni_telemetry_drop_partition(partition_name text)
RETURNS void LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp SET timezone = 'UTC'
AS $body$
DECLARE
    home constant text := {home};
    parent text := (regexp_match(partition_name, '^(telemetry_[a-z]+)_p[0-9]{{8}}$'))[1];
BEGIN
    IF parent IS NULL OR parent NOT IN ({daily}, {monthly}) THEN
        RAISE EXCEPTION '% is not the name of a telemetry partition', format('%L', partition_name)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NOT EXISTS (
        SELECT FROM pg_inherits i
        JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE c.relname = partition_name AND p.relname = parent AND p.relnamespace = c.relnamespace AND n.nspname = home
    ) THEN
        RAISE EXCEPTION '% is not a partition of %', partition_name, parent USING ERRCODE = 'invalid_parameter_value';
    END IF;
    EXECUTE format('ALTER TABLE %I.%I DETACH PARTITION %I.%I', home, parent, home, partition_name);
    EXECUTE format('DROP TABLE %I.%I', home, partition_name);
END
$body$"""

SIGNATURES = ("omni_telemetry_create_partition(text, timestamptz, timestamptz)", "omni_telemetry_drop_partition(text)")


def create_functions(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("SELECT quote_ident(current_schema()), quote_literal(current_schema())")
        schema, home = cursor.fetchone()
    lists = {
        "schema": schema,
        "home": home,
        "daily": ", ".join(f"'{name}'" for name in DAILY),
        "monthly": ", ".join(f"'{name}'" for name in MONTHLY),
    }
    for sql in (CREATE_PARTITION, DROP_PARTITION):
        schema_editor.execute(sql.format(**lists), params=None)
    for signature in SIGNATURES:
        schema_editor.execute(f"REVOKE EXECUTE ON FUNCTION {schema}.{signature} FROM PUBLIC", params=None)


def drop_functions(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for signature in SIGNATURES:
        schema_editor.execute(f"DROP FUNCTION IF EXISTS {signature}", params=None)


class Migration(migrations.Migration):

    dependencies = [
        ("telemetry", "0001_samples_rollups_sources"),
    ]

    operations = [
        migrations.RunPython(create_functions, drop_functions),
    ]
