"""``manage.py grant_app_role ROLE``: let the application's database role append to the audit log,
never rewrite it, and create and drop telemetry partitions only through their functions
(docs/audit-log.md, "Why it can be trusted")."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from jobs.audit import AUDIT_TABLE, RoleError, grant_app_role


class Command(BaseCommand):
    help = ("Run as the tables' owner (PostgreSQL): grant an existing ROLE normal DML on every table, "
            f"but only SELECT and INSERT on the audit table {AUDIT_TABLE}, and EXECUTE on the functions "
            "that create and drop telemetry partitions.")

    def add_arguments(self, parser) -> None:
        parser.add_argument("role", help="the role the application connects as (it must exist)")

    def handle(self, *args, role: str, **options) -> None:
        try:
            with transaction.atomic():
                grant_app_role(role)
        except RoleError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"granted {role}: DML on every table, SELECT and INSERT only on {AUDIT_TABLE}, "
                          "EXECUTE on the telemetry partition functions")
