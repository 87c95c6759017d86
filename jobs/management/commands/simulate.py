"""``manage.py simulate SCENARIO.json``: a thin shell around ``jobs.simulator.cli``.

Bad scenario files exit with status 2 and one line on stderr (no traceback), exactly like
``python -m jobs.simulator.cli``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from jobs.simulator.cli import add_arguments, run


class Command(BaseCommand):
    """Replay a scenario under omni, static and kill_preempt and report the metrics."""

    help = "Replay a scenario file under the scheduling policies (see docs/simulator.md)."

    def add_arguments(self, parser: CommandParser) -> None:
        """The same arguments as the standalone CLI."""
        add_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        """Run and exit with the CLI's status when it is not 0."""
        namespace = argparse.Namespace(**{k: options.get(k) for k in
                                          ("scenario", "policy", "json", "events", "html", "progress")})
        code = run(namespace, sys.stdout, sys.stderr)
        if code:
            raise SystemExit(code)
