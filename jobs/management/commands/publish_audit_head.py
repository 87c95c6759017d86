"""``manage.py publish_audit_head``: append the audit chain's head to the heads file (docs/audit-log.md)."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand

from jobs.audit import audit_key, publish_head


class Command(BaseCommand):
    help = ("Append the audit chain's head {id, hash, rows, at, mac} as one JSON line to OMNI_AUDIT_HEADS "
            "(fsynced); nothing when it has not moved since the last line.")

    def add_arguments(self, parser) -> None:
        parser.add_argument("--heads", type=Path, default=None,
                            help=f"the file to append to (default OMNI_AUDIT_HEADS, now {settings.OMNI_AUDIT_HEADS})")

    def handle(self, *args, heads: Path | None, **options) -> None:
        path = heads or settings.OMNI_AUDIT_HEADS
        head = publish_head(path, key=audit_key())
        if head is None:
            self.stdout.write(f"audit head unchanged (or the log is empty): nothing appended to {path}")
            return
        signed = "with its MAC" if head["mac"] else "without a MAC (OMNI_AUDIT_KEY is not set)"
        self.stdout.write(f"published audit head row {head['id']} ({head['rows']} rows) to {path}, {signed}")
