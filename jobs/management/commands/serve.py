"""``manage.py serve``: the ASGI server (daphne), plus the in-process loop in embedded mode."""

from __future__ import annotations

import logging

from django.conf import settings
from django.core.management.base import BaseCommand

logger = logging.getLogger(__name__)


class Command(BaseCommand):
    help = "Serve HTTP and WebSockets with daphne; in embedded mode also run the periodic tasks in-process."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--no-loop", action="store_true", help="do not run the in-process loop")

    def handle(self, *args, host: str, port: int, no_loop: bool, **options) -> None:
        from daphne.server import Server

        from omniweb.asgi import application
        from omniweb.loop import InProcessLoop

        loop = None
        if settings.OMNI_INPROCESS_LOOP and not no_loop:
            loop = InProcessLoop()
            loop.start()
        mode = "embedded (SQLite, in-memory channel layer)" if settings.EMBEDDED else "production"
        self.stdout.write(f"Omni serving on http://{host}:{port}/ in {mode} mode", ending="\n")
        self.stdout.flush()
        try:
            Server(
                application=application,
                endpoints=[f"tcp:port={port}:interface={host}"],
                signal_handlers=True,
                verbosity=0,
            ).run()
        finally:
            if loop is not None:
                loop.stop()
