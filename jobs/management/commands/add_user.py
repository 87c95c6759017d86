"""``manage.py add_user NAME --role researcher|operator|auditor [--password-file F]``: add an
account with one role (audited, through ``add_user``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import CommandError, CommandParser

from jobs.actions.accounts import add_user
from jobs.management.commands._operator import USAGE_ERROR, OperatorCommand
from jobs.roles import ROLES


class Command(OperatorCommand):
    help = ("Add a user with one role. With --password-file the password is the file's contents (less a trailing newline); without, "
            "the account has no usable password until one is set (an API token works meanwhile).")
    field_options = {"username": "NAME", "role": "--role", "password": "--password-file"}

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="user name (sign-in name)")
        parser.add_argument("--role", required=True, choices=ROLES)
        parser.add_argument("--password-file", type=Path, help="a file holding the password (a trailing newline is dropped)")

    def handle(self, *args: Any, name: str, role: str, password_file: Path | None, **options: Any) -> None:
        password = None if password_file is None else self._read_password(password_file)
        user = add_user(None, username=name, role=role, password=password)
        self.stdout.write(f"Added user {user.get_username()} ({role}).")
        if password is None:
            self.stdout.write(
                f"No password yet: they sign in once one is set (manage.py changepassword {name}); "
                f"meanwhile an API token works (manage.py issue_api_token {name})."
            )

    def _read_password(self, path: Path) -> str:
        try:
            password = path.read_text(encoding="utf-8").rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise CommandError(f"--password-file: cannot read {path}: {reason}", returncode=USAGE_ERROR) from None
        if not password:
            raise CommandError(f"--password-file: {path} holds no password", returncode=USAGE_ERROR)
        if "\n" in password:
            raise CommandError(f"--password-file: {path} holds more than one line", returncode=USAGE_ERROR)
        return password
