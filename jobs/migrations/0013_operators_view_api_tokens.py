"""Operators see the admin's API token list (prefixes only), whose bulk action revokes tokens
through the audited ``revoke_api_token``; without ``view_apitoken`` the page answered them 403."""

from django.db import migrations

GRANTED = {"operator": ["view_apitoken"]}


def grant(apps, schema_editor):
    # Permissions are created by a post_migrate signal, so make sure they exist first.
    from django.contrib.auth.management import create_permissions

    for app_config in apps.get_app_configs():
        app_config.models_module = True
        create_permissions(app_config, apps=apps, verbosity=0)
        app_config.models_module = None
    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    for role, codenames in GRANTED.items():
        group, _ = Group.objects.get_or_create(name=role)
        group.permissions.add(*Permission.objects.filter(content_type__app_label="jobs", codename__in=codenames))


def revoke(apps, schema_editor):
    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    for role, codenames in GRANTED.items():
        for group in Group.objects.filter(name=role):
            group.permissions.remove(*Permission.objects.filter(content_type__app_label="jobs", codename__in=codenames))


class Migration(migrations.Migration):
    dependencies = [("jobs", "0012_token_revoked")]

    operations = [
        migrations.AlterModelOptions(name="apitoken", options={"ordering": ["-created_at"], "verbose_name": "API token"}),
        migrations.RunPython(grant, revoke),
    ]
