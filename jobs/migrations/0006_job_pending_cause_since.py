"""Why a job waits, and since when: Job.pending_cause (the planner's current hold cause) and
Job.pending_since (when it began); a hold is audited only when the cause changes."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0005_admin_edit_event_kinds'),
    ]

    operations = [
        migrations.AddField(
            model_name='job',
            name='pending_cause',
            field=models.CharField(blank=True, default='', help_text="The cause of the planner's current hold (capacity, cannot_fit, ...); empty when not held.", max_length=32),
        ),
        migrations.AddField(
            model_name='job',
            name='pending_since',
            field=models.DateTimeField(blank=True, help_text='When the current hold cause began.', null=True),
        ),
    ]
