"""``manage.py issue_api_token NAME [--label L]``: a new API token for a user, printed once
(alone on stdout, for scripts); only its digest is stored. Used as ``Authorization: Token
<token>`` on the REST API (jobs.api.auth)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import CommandError, CommandParser

from jobs.actions.accounts import issue_api_token
from jobs.management.commands._operator import USAGE_ERROR, OperatorCommand


class Command(OperatorCommand):
    help = "Issue an API token for user NAME and print it once; only its hash is stored."
    field_options = {"label": "--label", "user": "NAME"}

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="user name")
        parser.add_argument("--label", default="", help="what the token is for (e.g. 'laptop', 'ci')")

    def handle(self, *args: Any, name: str, label: str, **options: Any) -> None:
        try:
            user = get_user_model().objects.get_by_natural_key(name)
        except get_user_model().DoesNotExist:
            raise CommandError(f"no user named {name!r}", returncode=USAGE_ERROR) from None
        row, token = issue_api_token(None, user, label=label)
        self.stdout.write(token)
        # The note goes to stderr so that TOKEN=$(manage.py issue_api_token NAME) holds the token alone.
        self.stderr.write(
            f"API token {row.prefix}… for {name}: shown this once, stored only as a hash. "
            f"Send it as 'Authorization: Token <token>'.",
            style_func=lambda text: text,
        )
