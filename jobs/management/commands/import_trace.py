"""``manage.py import_trace philly|acme FILE --out SCENARIO.json``: build a scenario from a public trace.

A thin shell around :mod:`jobs.simulator.traces`; every option maps to one field of
``ImportOptions`` and every assumption is described in ``docs/traces.md``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, NoReturn

from django.core.management.base import BaseCommand, CommandError, CommandParser

from jobs.simulator.traces import (
    OPTION_HELP,
    TRACE_SOURCES,
    ImportOptions,
    TraceError,
    import_trace,
    options_with,
)


class Command(BaseCommand):
    """Write a FORMAT.md scenario from a Philly or Acme Kalos trace file."""

    help = "Turn a public GPU-cluster trace (philly, acme) into a simulator scenario file."

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        """Argument errors on the command line are one line on stderr and exit 2, not a usage dump."""
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        if getattr(self, "_called_from_command_line", False):
            def one_line_error(message: str) -> NoReturn:
                sys.stderr.write(f"import_trace: {message}\n")
                sys.exit(2)

            parser.error = one_line_error  # type: ignore[method-assign]
        return parser

    def add_arguments(self, parser: CommandParser) -> None:
        """One flag per import option; unset flags keep the source's defaults."""
        parser.add_argument("source", choices=TRACE_SOURCES, help="which trace format FILE is in")
        parser.add_argument("file", help="the trace CSV (shared/traces/philly/philly.csv or acme-kalos/kalos.csv)")
        parser.add_argument("--out", required=True, help="where to write the scenario JSON")
        for field in fields(ImportOptions):
            flag = "--" + field.name.replace("_", "-")
            if field.type in (bool, "bool"):
                parser.add_argument(flag, dest=field.name, action="store_true", default=None,
                                    help=OPTION_HELP.get(field.name, ""))
                continue
            kind = {"int": int, "float": float, "str": str}[field.type if isinstance(field.type, str)
                                                            else field.type.__name__]
            parser.add_argument(flag, dest=field.name, type=kind, default=None, help=OPTION_HELP.get(field.name, ""))

    def handle(self, *args: Any, **options: Any) -> None:
        """Import, write, and print one summary line; bad input exits 2 with one line."""
        overrides = {field.name: options.get(field.name) for field in fields(ImportOptions)}
        try:
            import_options = options_with(options["source"], overrides)
            scenario = import_trace(options["source"], options["file"], import_options)
        except TraceError as exc:
            raise CommandError(str(exc), returncode=2) from None
        out = Path(options["out"])
        try:
            out.write_text(json.dumps(scenario, indent=1) + "\n", encoding="utf-8")
        except OSError as exc:
            raise CommandError(f"--out {out}: {exc.strerror}", returncode=2) from None
        jobs = scenario["jobs"]
        self.stdout.write(
            f"{out}: {len(jobs)} jobs ({sum(job['priority'] == 'critical' for job in jobs)} critical), "
            f"{len(scenario['reservations'])} reservations, horizon {scenario['horizon_s']:g} s"
        )
