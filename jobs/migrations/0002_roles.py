"""Create the three role groups and give them their model permissions."""

from django.db import migrations

ROLE_PERMISSIONS = {
    "researcher": ["view_job", "add_job", "view_node", "view_reservation", "view_allocation"],
    "operator": [
        "view_job", "add_job", "change_job", "view_node", "change_node", "view_reservation",
        "add_reservation", "change_reservation", "view_allocation", "view_command",
        "view_elasticevent", "view_plannerrun", "view_plannercontrol", "change_plannercontrol",
    ],
    "auditor": [
        "view_job", "view_node", "view_reservation", "view_allocation", "view_command",
        "view_elasticevent", "view_plannerrun", "view_plannercontrol",
    ],
}


def create_roles(apps, schema_editor):
    # Permissions are created by a post_migrate signal, so make sure they exist first.
    from django.contrib.auth.management import create_permissions

    for app_config in apps.get_app_configs():
        app_config.models_module = True
        create_permissions(app_config, apps=apps, verbosity=0)
        app_config.models_module = None
    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    for role, codenames in ROLE_PERMISSIONS.items():
        group, _ = Group.objects.get_or_create(name=role)
        group.permissions.set(Permission.objects.filter(content_type__app_label="jobs", codename__in=codenames))


def remove_roles(apps, schema_editor):
    apps.get_model("auth", "Group").objects.filter(name__in=list(ROLE_PERMISSIONS)).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0001_initial"),
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]

    operations = [migrations.RunPython(create_roles, remove_roles)]
