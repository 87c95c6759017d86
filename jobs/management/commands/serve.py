"""``manage.py serve``: the ASGI server (daphne), plus the in-process loop in embedded mode."""

from __future__ import annotations

import logging

from django.conf import settings
from django.core.management.base import BaseCommand

logger = logging.getLogger(__name__)


def _leave_bodies_to_django() -> None:
    """Make daphne hand every POST body to Django unparsed.

    Twisted's ``Request`` parses a POST's form body on its own (``request.args``, which daphne
    never reads) before daphne sees the request, and answers a multipart body it cannot parse
    (``--boundary--`` and nothing else) with a bare 400: no content type, no body, nothing in
    any log, Django never called. With ``parsePOSTFormSubmission=False`` Django parses every body
    and bad ones get the API's 400 with field messages (docs/api.md). Daphne offers no option
    for it, so its request class is swapped for one that passes the flag.
    """
    from daphne import http_protocol

    if getattr(http_protocol.WebRequest, "leaves_bodies_to_django", False):
        return

    class BodiesLeftToDjango(http_protocol.WebRequest):
        leaves_bodies_to_django = True

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, parsePOSTFormSubmission=False, **kwargs)

    http_protocol.WebRequest = BodiesLeftToDjango


# Request line and headers together: Twisted's 16 KiB refused a 26 KiB query string (schemathesis
# seed 2467894874, a list endpoint's repeated filters) with a bare 400 and a close while the
# client was still sending, so the client saw the connection reset and no answer at all.
MAX_REQUEST_HEAD_BYTES = 256 * 1024


def _allow_long_request_heads() -> None:
    """Let a request line and headers of up to ``MAX_REQUEST_HEAD_BYTES`` through to Django,
    which answers what it cannot take (too many query fields: its 400) in words. Beyond that
    Twisted still refuses, as a proxy in front would (docs/api.md)."""
    from twisted.web import http

    http.HTTPChannel.MAX_LENGTH = MAX_REQUEST_HEAD_BYTES
    http.HTTPChannel.totalHeadersSize = MAX_REQUEST_HEAD_BYTES


class Command(BaseCommand):
    help = "Serve HTTP and WebSockets with daphne; in embedded mode also run the periodic tasks in-process."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--no-loop", action="store_true", help="do not run the in-process loop")

    def handle(self, *args, host: str, port: int, no_loop: bool, **options) -> None:
        from daphne.server import Server
        from twisted.internet import reactor

        from omniweb.asgi import application
        from omniweb.loop import InProcessLoop

        _leave_bodies_to_django()
        _allow_long_request_heads()
        loop = None
        if settings.OMNI_INPROCESS_LOOP and not no_loop:
            # Its live updates go through the server's loop (jobs.live.send_through): the asyncio
            # loop daphne runs its reactor on, as daphne itself finds it.
            loop = InProcessLoop(live_loop=reactor._asyncioEventloop)
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
