"""``manage.py issue_agent_token NODE``: make a node's agent token and print it, once."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.db import transaction

from jobs.management.commands._operator import USAGE_ERROR, OperatorCommand
from jobs.models import Node


class Command(OperatorCommand):
    help = "Issue a new agent token for NODE (replacing any old one) and print it once; only its hash is stored."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("node", help="node name")

    @transaction.atomic
    def handle(self, *args: Any, node: str, **options: Any) -> None:
        try:
            target = Node.objects.select_for_update(no_key=True).get(name=node)
        except Node.DoesNotExist:
            raise CommandError(f"no node named {node!r}", returncode=USAGE_ERROR) from None
        token = target.issue_token()
        target.save(update_fields=["agent_token_hash"])
        self.stdout.write(token)
