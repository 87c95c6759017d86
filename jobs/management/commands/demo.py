"""``manage.py demo``: serve the seeded cluster and print where to look and how to log in."""

from __future__ import annotations

from django.core.management import call_command
from django.core.management.base import BaseCommand

from jobs.management.commands.seed_demo import DEMO_PASSWORD, DEMO_USERS


class Command(BaseCommand):
    help = "Serve the demo: the web UI, the API and the in-process planner loop."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)

    def handle(self, *args, host: str, port: int, **options) -> None:
        url = f"http://{host}:{port}/"
        self.stdout.write("")
        self.stdout.write(f"  Omni demo: open {url}")
        for name, role, _ in DEMO_USERS:
            self.stdout.write(f"    {name:<8} {role:<11} password {DEMO_PASSWORD}")
        self.stdout.write(f"  API: {url}api/   OpenAPI schema: {url}api/schema/   Admin: {url}admin/")
        self.stdout.write("  Stop with Ctrl-C.")
        self.stdout.write("")
        call_command("serve", host=host, port=port)
