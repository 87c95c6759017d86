"""Operators see every list the admin shows: the API tokens (prefixes only; its bulk action
revokes through the audited ``revoke_api_token``), teams and their members, allocation spans and
the telemetry streams. 0002 granted only the models of its day, so these pages answered them 403."""

from django.db import migrations

GRANTED = {  # role: {app: codenames}
    "operator": {
        "jobs": ["view_apitoken", "view_team", "view_teammembership", "view_allocationspan"],
        "telemetry": ["view_telemetrysource", "view_rollupwatermark"],
    },
}


def grant(apps, schema_editor):
    # Permissions are created by a post_migrate signal, so make sure they exist first.
    from django.contrib.auth.management import create_permissions

    for app_config in apps.get_app_configs():
        app_config.models_module = True
        create_permissions(app_config, apps=apps, verbosity=0)
        app_config.models_module = None
    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    for role, apps_codenames in GRANTED.items():
        group, _ = Group.objects.get_or_create(name=role)
        for app, codenames in apps_codenames.items():
            group.permissions.add(*Permission.objects.filter(content_type__app_label=app, codename__in=codenames))


def revoke(apps, schema_editor):
    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    for role, apps_codenames in GRANTED.items():
        for group in Group.objects.filter(name=role):
            for app, codenames in apps_codenames.items():
                group.permissions.remove(*Permission.objects.filter(content_type__app_label=app,
                                                                    codename__in=codenames))


class Migration(migrations.Migration):
    dependencies = [("jobs", "0012_token_revoked"), ("telemetry", "0002_partition_functions")]

    operations = [
        migrations.AlterModelOptions(name="apitoken", options={"ordering": ["-created_at"], "verbose_name": "API token"}),
        migrations.RunPython(grant, revoke),
    ]
