"""Telemetry tables. Samples and rollups are written in SQL by vendor: natively partitioned by
time on PostgreSQL (partitions themselves are created on demand and ahead of time by
telemetry.partitions), plain tables on SQLite. Their models are managed=False. The SQL is
spelled out here, not imported from app code, so this migration never changes under it.
"""

import django.db.models.deletion
from django.db import migrations, models


# Columns shared by both vendors; {ts} is the timestamp type, {real} the 4-byte float type.
GPU_SAMPLE = """
CREATE TABLE telemetry_gpusample (
    node_id bigint NOT NULL, gpu_index smallint NOT NULL, at {ts} NOT NULL,
    util_pct {real} NOT NULL, mem_used_bytes bigint NOT NULL, power_w {real}, temp_c {real},
    xid_errors integer NOT NULL DEFAULT 0,
    PRIMARY KEY (node_id, gpu_index, at)
){part_at}"""

STEP_RECORD = """
CREATE TABLE telemetry_steprecord (
    job_id bigint NOT NULL, rank integer NOT NULL, step bigint NOT NULL, at {ts} NOT NULL,
    node_id bigint NOT NULL, step_s {real} NOT NULL, data_wait_s {real}, compute_s {real}, comm_s {real},
    tokens_text bigint, tokens_image bigint, tokens_video bigint, tokens_audio bigint, loss {real},
    PRIMARY KEY (job_id, rank, step, at)
){part_at}"""

GPU_ROLLUP = """
CREATE TABLE {table} (
    node_id bigint NOT NULL, gpu_index smallint NOT NULL, bucket {ts} NOT NULL, samples integer NOT NULL,
    util_mean_pct {real} NOT NULL, util_max_pct {real} NOT NULL, util_p95_pct {real},
    mem_mean_bytes bigint NOT NULL, mem_max_bytes bigint NOT NULL,
    power_mean_w {real}, power_max_w {real}, temp_mean_c {real}, temp_max_c {real},
    xid_errors_max integer NOT NULL,
    PRIMARY KEY (node_id, gpu_index, bucket)
){part_bucket}"""

STEP_ROLLUP = """
CREATE TABLE {table} (
    job_id bigint NOT NULL, bucket {ts} NOT NULL, records integer NOT NULL, ranks integer NOT NULL,
    step_max bigint NOT NULL, step_s_mean {real} NOT NULL, step_s_max {real} NOT NULL, step_s_p95 {real},
    data_wait_s_mean {real}, compute_s_mean {real}, comm_s_mean {real},
    tokens_text_sum bigint, tokens_image_sum bigint, tokens_video_sum bigint, tokens_audio_sum bigint,
    loss_mean {real},
    PRIMARY KEY (job_id, bucket)
){part_bucket}"""

TABLES = [
    ("telemetry_gpusample", GPU_SAMPLE),
    ("telemetry_steprecord", STEP_RECORD),
    ("telemetry_gpuminute", GPU_ROLLUP),
    ("telemetry_gpuhour", GPU_ROLLUP),
    ("telemetry_stepminute", STEP_ROLLUP),
    ("telemetry_stephour", STEP_ROLLUP),
]


def create_tables(apps, schema_editor):
    postgres = schema_editor.connection.vendor == "postgresql"
    types = {
        "ts": "timestamptz" if postgres else "datetime",
        "real": "real",
        "part_at": " PARTITION BY RANGE (at)" if postgres else "",
        "part_bucket": " PARTITION BY RANGE (bucket)" if postgres else "",
    }
    for table, sql in TABLES:
        schema_editor.execute(sql.format(table=table, **types), params=None)
    if not postgres:
        # Range scans by time over all GPUs (cluster utilisation) on SQLite; PostgreSQL prunes
        # partitions instead.
        schema_editor.execute("CREATE INDEX telemetry_gpusample_at ON telemetry_gpusample (at)", params=None)
        schema_editor.execute("CREATE INDEX telemetry_steprecord_at ON telemetry_steprecord (at)", params=None)


def drop_tables(apps, schema_editor):
    for table, _ in reversed(TABLES):
        schema_editor.execute(f"DROP TABLE IF EXISTS {table}", params=None)


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ('jobs', '0003_audit_append_only'),
    ]

    operations = [
        migrations.CreateModel(
            name='GpuHour',
            fields=[
                ('pk', models.CompositePrimaryKey('node', 'gpu_index', 'bucket', blank=True, editable=False, primary_key=True, serialize=False)),
                ('gpu_index', models.SmallIntegerField()),
                ('bucket', models.DateTimeField(help_text='Start of the bucket.')),
                ('samples', models.IntegerField()),
                ('util_mean_pct', models.FloatField()),
                ('util_max_pct', models.FloatField()),
                ('util_p95_pct', models.FloatField(help_text='PostgreSQL only (percentile_cont).', null=True)),
                ('mem_mean_bytes', models.BigIntegerField()),
                ('mem_max_bytes', models.BigIntegerField()),
                ('power_mean_w', models.FloatField(null=True)),
                ('power_max_w', models.FloatField(null=True)),
                ('temp_mean_c', models.FloatField(null=True)),
                ('temp_max_c', models.FloatField(null=True)),
                ('xid_errors_max', models.IntegerField()),
            ],
            options={
                'db_table': 'telemetry_gpuhour',
                'managed': False,
            },
        ),
        migrations.CreateModel(
            name='GpuMinute',
            fields=[
                ('pk', models.CompositePrimaryKey('node', 'gpu_index', 'bucket', blank=True, editable=False, primary_key=True, serialize=False)),
                ('gpu_index', models.SmallIntegerField()),
                ('bucket', models.DateTimeField(help_text='Start of the bucket.')),
                ('samples', models.IntegerField()),
                ('util_mean_pct', models.FloatField()),
                ('util_max_pct', models.FloatField()),
                ('util_p95_pct', models.FloatField(help_text='PostgreSQL only (percentile_cont).', null=True)),
                ('mem_mean_bytes', models.BigIntegerField()),
                ('mem_max_bytes', models.BigIntegerField()),
                ('power_mean_w', models.FloatField(null=True)),
                ('power_max_w', models.FloatField(null=True)),
                ('temp_mean_c', models.FloatField(null=True)),
                ('temp_max_c', models.FloatField(null=True)),
                ('xid_errors_max', models.IntegerField()),
            ],
            options={
                'db_table': 'telemetry_gpuminute',
                'managed': False,
            },
        ),
        migrations.CreateModel(
            name='GpuSample',
            fields=[
                ('pk', models.CompositePrimaryKey('node', 'gpu_index', 'at', blank=True, editable=False, primary_key=True, serialize=False)),
                ('gpu_index', models.SmallIntegerField()),
                ('at', models.DateTimeField()),
                ('util_pct', models.FloatField()),
                ('mem_used_bytes', models.BigIntegerField()),
                ('power_w', models.FloatField(null=True)),
                ('temp_c', models.FloatField(null=True)),
                ('xid_errors', models.IntegerField(default=0)),
            ],
            options={
                'db_table': 'telemetry_gpusample',
                'managed': False,
            },
        ),
        migrations.CreateModel(
            name='StepHour',
            fields=[
                ('pk', models.CompositePrimaryKey('job', 'bucket', blank=True, editable=False, primary_key=True, serialize=False)),
                ('bucket', models.DateTimeField(help_text='Start of the bucket.')),
                ('records', models.IntegerField()),
                ('ranks', models.IntegerField()),
                ('step_max', models.BigIntegerField()),
                ('step_s_mean', models.FloatField()),
                ('step_s_max', models.FloatField()),
                ('step_s_p95', models.FloatField(help_text='PostgreSQL only (percentile_cont).', null=True)),
                ('data_wait_s_mean', models.FloatField(null=True)),
                ('compute_s_mean', models.FloatField(null=True)),
                ('comm_s_mean', models.FloatField(null=True)),
                ('tokens_text_sum', models.BigIntegerField(null=True)),
                ('tokens_image_sum', models.BigIntegerField(null=True)),
                ('tokens_video_sum', models.BigIntegerField(null=True)),
                ('tokens_audio_sum', models.BigIntegerField(null=True)),
                ('loss_mean', models.FloatField(null=True)),
            ],
            options={
                'db_table': 'telemetry_stephour',
                'managed': False,
            },
        ),
        migrations.CreateModel(
            name='StepMinute',
            fields=[
                ('pk', models.CompositePrimaryKey('job', 'bucket', blank=True, editable=False, primary_key=True, serialize=False)),
                ('bucket', models.DateTimeField(help_text='Start of the bucket.')),
                ('records', models.IntegerField()),
                ('ranks', models.IntegerField()),
                ('step_max', models.BigIntegerField()),
                ('step_s_mean', models.FloatField()),
                ('step_s_max', models.FloatField()),
                ('step_s_p95', models.FloatField(help_text='PostgreSQL only (percentile_cont).', null=True)),
                ('data_wait_s_mean', models.FloatField(null=True)),
                ('compute_s_mean', models.FloatField(null=True)),
                ('comm_s_mean', models.FloatField(null=True)),
                ('tokens_text_sum', models.BigIntegerField(null=True)),
                ('tokens_image_sum', models.BigIntegerField(null=True)),
                ('tokens_video_sum', models.BigIntegerField(null=True)),
                ('tokens_audio_sum', models.BigIntegerField(null=True)),
                ('loss_mean', models.FloatField(null=True)),
            ],
            options={
                'db_table': 'telemetry_stepminute',
                'managed': False,
            },
        ),
        migrations.CreateModel(
            name='StepRecord',
            fields=[
                ('pk', models.CompositePrimaryKey('job', 'rank', 'step', 'at', blank=True, editable=False, primary_key=True, serialize=False)),
                ('rank', models.IntegerField()),
                ('step', models.BigIntegerField()),
                ('at', models.DateTimeField(help_text='When the step finished.')),
                ('step_s', models.FloatField()),
                ('data_wait_s', models.FloatField(null=True)),
                ('compute_s', models.FloatField(null=True)),
                ('comm_s', models.FloatField(null=True)),
                ('tokens_text', models.BigIntegerField(null=True)),
                ('tokens_image', models.BigIntegerField(null=True)),
                ('tokens_video', models.BigIntegerField(null=True)),
                ('tokens_audio', models.BigIntegerField(null=True)),
                ('loss', models.FloatField(null=True)),
            ],
            options={
                'db_table': 'telemetry_steprecord',
                'managed': False,
            },
        ),
        migrations.CreateModel(
            name='RollupWatermark',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('level', models.CharField(max_length=32, unique=True)),
                ('rolled_until', models.DateTimeField()),
                ('updated_at', models.DateTimeField(auto_now=True)),
            ],
        ),
        migrations.CreateModel(
            name='TelemetrySource',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('name', models.CharField(max_length=128)),
                ('kind', models.CharField(choices=[('gpu', 'GPU samples'), ('steps', 'Step records')], max_length=8)),
                ('high_seq', models.BigIntegerField(default=-1)),
                ('window', models.BinaryField(default=b'')),
                ('batches_total', models.BigIntegerField(default=0)),
                ('samples_total', models.BigIntegerField(default=0)),
                ('duplicates_total', models.BigIntegerField(default=0)),
                ('created_at', models.DateTimeField(auto_now_add=True)),
                ('last_batch_at', models.DateTimeField(blank=True, null=True)),
                ('last_sample_at', models.DateTimeField(blank=True, null=True)),
                ('last_lag_s', models.FloatField(blank=True, help_text="Acceptance time minus the newest sample's time, last batch.", null=True)),
                ('node', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='telemetry_sources', to='jobs.node')),
            ],
            options={
                'constraints': [models.UniqueConstraint(fields=('node', 'name', 'kind'), name='telemetry_source_unique')],
            },
        ),
        migrations.RunPython(create_tables, drop_tables),
    ]
