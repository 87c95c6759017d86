"""Allocation history: one AllocationSpan per GPU a job holds or held, and an open span for
every allocation that exists already (from its ``since``)."""

import django.db.models.deletion
from django.db import migrations, models


def open_spans_for_current_allocations(apps, schema_editor) -> None:
    allocation_model = apps.get_model("jobs", "Allocation")
    span_model = apps.get_model("jobs", "AllocationSpan")
    db = schema_editor.connection.alias
    span_model.objects.using(db).bulk_create(
        (
            span_model(job_id=job_id, node_id=node_id, gpu_index=gpu_index, borrowed_from_id=borrowed_from_id,
                       started_at=since)
            for job_id, node_id, gpu_index, borrowed_from_id, since in allocation_model.objects.using(db)
            .order_by("pk").values_list("job_id", "node_id", "gpu_index", "borrowed_from_id", "since")
            .iterator(chunk_size=2000)
        ),
        batch_size=2000,
    )


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0003_audit_append_only'),
    ]

    operations = [
        migrations.CreateModel(
            name='AllocationSpan',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('gpu_index', models.PositiveSmallIntegerField()),
                ('started_at', models.DateTimeField()),
                ('ended_at', models.DateTimeField(blank=True, help_text='Empty while the job still holds the GPU.', null=True)),
                ('borrowed_from', models.ForeignKey(blank=True, help_text='The reservation the GPU was lent from, if it was a loan.', null=True, on_delete=django.db.models.deletion.PROTECT, related_name='+', to='jobs.reservation')),
                ('job', models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='allocation_spans', to='jobs.job')),
                ('node', models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.PROTECT, related_name='allocation_spans', to='jobs.node')),
            ],
            options={
                'ordering': ['started_at', 'id'],
                'indexes': [models.Index(fields=['job', 'started_at'], name='span_by_job'), models.Index(fields=['node', 'gpu_index', 'started_at'], name='span_by_gpu')],
                'constraints': [models.UniqueConstraint(condition=models.Q(('ended_at__isnull', True)), fields=('node', 'gpu_index'), name='one_open_span_per_gpu'), models.CheckConstraint(condition=models.Q(('ended_at__isnull', True), ('ended_at__gte', models.F('started_at')), _connector='OR'), name='span_ends_after_start')],
            },
        ),
        migrations.RunPython(open_spans_for_current_allocations, migrations.RunPython.noop),
    ]
