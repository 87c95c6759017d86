"""What the operators' commands share (``add_node``, ``add_user``, ``issue_api_token``,
``issue_agent_token``; docs/operators.md): every refusal, a bad argument included, is one line on
stderr, ``add_node: error: MESSAGE``, and exit status 2, like ``trainer_agent.train`` and
``simulate``; never argparse's usage block or a traceback. What they change goes through the
audited actions with ``actor`` None, the server's own command line (audited as ``system``).
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, handle_default_options
from django.db import connections

USAGE_ERROR = 2


def refusal(exc: ValidationError, options: dict[str, str]) -> str:
    """An action's ValidationError as one line, each field named as the command spells it
    (``options``: ``{"gpu_count": "--gpus"}``)."""
    if not hasattr(exc, "error_dict"):
        return " ".join(exc.messages)
    return "; ".join(
        f"{options.get(field, field)}: {' '.join(messages)}" for field, messages in exc.message_dict.items()
    )


class OperatorCommand(BaseCommand):
    """A command an operator types on the server. ``field_options`` maps an action's field names
    to the command's own, so a refusal names what the operator typed."""

    field_options: dict[str, str] = {}

    def execute(self, *args: Any, **options: Any) -> Any:
        try:
            return super().execute(*args, **options)
        except ValidationError as exc:
            raise CommandError(refusal(exc, self.field_options), returncode=USAGE_ERROR) from None

    def run_from_argv(self, argv: list[str]) -> None:
        # BaseCommand.run_from_argv, except for how it fails. Its parser is left as call_command
        # gets it, where a bad argument raises CommandError("Error: ...") instead of printing the
        # usage block and exiting.
        name = argv[1]
        parser = self.create_parser(argv[0], name)
        try:
            options = parser.parse_args(argv[2:])
        except CommandError as exc:
            self._refuse(name, str(exc).removeprefix("Error: "), USAGE_ERROR)
        cmd_options = vars(options)
        args = cmd_options.pop("args", ())
        handle_default_options(options)
        try:
            self.execute(*args, **cmd_options)
        except CommandError as exc:
            if options.traceback:
                raise
            self._refuse(name, str(exc), exc.returncode)
        finally:
            connections.close_all()

    def _refuse(self, name: str, message: str, code: int) -> NoReturn:
        one_line = " ".join(message.split())
        sys.stderr.write(f"{name}: error: {one_line}\n")
        sys.stderr.flush()
        sys.exit(code)
