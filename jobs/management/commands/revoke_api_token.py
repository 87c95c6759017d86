"""``manage.py revoke_api_token PREFIX [--user NAME]``: revoke an API token by the first
characters it was issued with (``issue_api_token`` and the audit log show them), or by the token
itself, audited. A prefix that names no live token, or several (``--user`` then tells them apart),
is refused with exit status 2."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from jobs.actions.accounts import revoke_api_token
from jobs.management.commands._operator import USAGE_ERROR, OperatorCommand
from jobs.models import ApiToken, hash_api_token
from jobs.models.tokens import PREFIX_CHARS, TOKEN_START


class Command(OperatorCommand):
    help = "Revoke the API token whose first characters are PREFIX (as issue_api_token printed them)."
    field_options = {"token": "PREFIX", "user": "--user"}

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("prefix", help="the token's first characters after 'omni_' (6), or the token itself")
        parser.add_argument("--user", default=None, help="the token's user, when several tokens share the prefix")

    def handle(self, *args: Any, prefix: str, user: str | None, **options: Any) -> None:
        given = prefix.strip()
        rows = ApiToken.objects.select_related("user")
        if given.startswith(TOKEN_START) and len(given) > len(TOKEN_START) + PREFIX_CHARS:  # the token itself
            rows, missing = rows.filter(digest=hash_api_token(given)), "no API token is that token"
        else:
            prefix = given.removeprefix(TOKEN_START).rstrip("…")[:PREFIX_CHARS]
            if len(prefix) < PREFIX_CHARS:
                raise CommandError(f"PREFIX: {prefix!r} is shorter than a token's {PREFIX_CHARS} characters",
                                   returncode=USAGE_ERROR)
            rows, missing = rows.filter(prefix=prefix), f"no API token begins with {prefix!r}"
        if user is not None:
            rows = rows.filter(user__username=user)
            missing += f" for {user}"
        rows = list(rows)
        live = [row for row in rows if row.revoked_at is None]
        if not live and rows:
            raise CommandError(f"API token {rows[0].prefix}… was already revoked at "
                               f"{rows[0].revoked_at.isoformat(timespec='seconds')}", returncode=USAGE_ERROR)
        if not live:
            raise CommandError(missing, returncode=USAGE_ERROR)
        if len(live) > 1:
            owners = ", ".join(sorted(row.user.get_username() for row in live))
            raise CommandError(f"{len(live)} live API tokens begin with {live[0].prefix!r} ({owners}): name one with --user",
                               returncode=USAGE_ERROR)
        row = revoke_api_token(None, live[0])
        self.stdout.write(f"Revoked API token {row.prefix}… of {row.user.get_username()}"
                          + (f" ({row.label})" if row.label else "") + ".")
