"""``manage.py revoke_api_token PREFIX [--user NAME]``: revoke an API token by the first
characters it was issued with (``issue_api_token`` prints them; the audit log and the admin show
them), audited. A prefix that names no live token, or several (``--user`` then tells them apart),
is refused with exit status 2."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from jobs.actions.accounts import revoke_api_token
from jobs.management.commands._operator import USAGE_ERROR, OperatorCommand
from jobs.models import ApiToken, hash_api_token


class Command(OperatorCommand):
    help = "Revoke the API token whose first characters are PREFIX (as issue_api_token printed them)."
    field_options = {"token": "PREFIX", "user": "--user"}

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("prefix", help="the token's first characters after 'omni_' (6), or the token itself")
        parser.add_argument("--user", default=None, help="the token's user, when several tokens share the prefix")

    def handle(self, *args: Any, prefix: str, user: str | None, **options: Any) -> None:
        given = prefix.strip()
        if len(given) > 20:  # the token itself: its digest names exactly one row
            row = ApiToken.objects.select_related("user").filter(digest=hash_api_token(given)).first()
            if row is None:
                raise CommandError("no API token is that token", returncode=USAGE_ERROR)
            given, user = row.prefix, row.user.get_username()
        prefix = given.removeprefix("omni_").rstrip("…")[:6]
        if len(prefix) < 6:
            raise CommandError(f"PREFIX: {prefix!r} is shorter than a token's 6 characters", returncode=USAGE_ERROR)
        rows = ApiToken.objects.select_related("user").filter(prefix=prefix)
        if user is not None:
            rows = rows.filter(user__username=user)
        live = [row for row in rows if row.revoked_at is None]
        if not live:
            revoked = [row for row in rows if row.revoked_at is not None]
            if revoked:
                raise CommandError(f"API token {prefix}… was already revoked at "
                                   f"{revoked[0].revoked_at.isoformat(timespec='seconds')}", returncode=USAGE_ERROR)
            raise CommandError(f"no API token begins with {prefix!r}" + (f" for {user}" if user else ""),
                               returncode=USAGE_ERROR)
        if len(live) > 1:
            owners = ", ".join(sorted(row.user.get_username() for row in live))
            raise CommandError(f"{len(live)} live API tokens begin with {prefix!r} ({owners}): name one with --user",
                               returncode=USAGE_ERROR)
        row = revoke_api_token(None, live[0])
        self.stdout.write(f"Revoked API token {row.prefix}… of {row.user.get_username()}"
                          + (f" ({row.label})" if row.label else "") + ".")
