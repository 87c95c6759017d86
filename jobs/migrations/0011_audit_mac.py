"""Each audit row's MAC: HMAC-SHA256 of its hash under a key kept outside the database."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("jobs", "0010_teams")]

    operations = [
        migrations.AddField(
            model_name="elasticevent",
            name="mac",
            field=models.CharField(
                blank=True, default="", editable=False, max_length=64,
                help_text="HMAC-SHA256(OMNI_AUDIT_KEY, hash); blank for rows written without a key.",
            ),
        ),
    ]
