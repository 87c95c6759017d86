"""``manage.py verify_audit``: walk the audit hash chain (and MACs, with the key), check it against
the published heads, and name what does not hold (docs/audit-log.md)."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from jobs.audit import audit_key, verify_chain, verify_heads


class Command(BaseCommand):
    help = ("Verify the audit log's hash chain, its MACs when OMNI_AUDIT_KEY is set, and every published head; "
            "exit 1 naming the first bad row and every head the chain no longer matches.")

    def add_arguments(self, parser) -> None:
        parser.add_argument("--heads", type=Path, default=None,
                            help="a copy of the heads file kept elsewhere (default OMNI_AUDIT_HEADS, "
                                 "which may be absent)")

    def handle(self, *args, heads: Path | None, **options) -> None:
        key = audit_key()
        report = verify_chain(key=key)
        broken = not report.ok
        if report.ok:
            self.stdout.write(f"audit chain intact: {report.rows_checked} rows verified"
                              + (f" (up to row {report.last_good_id})" if report.last_good_id else ""))
        else:
            good = f"rows up to {report.last_good_id} verified" if report.last_good_id else "no row verified"
            self.stderr.write(f"audit chain BROKEN at row {report.first_bad_id}: {report.problem} ({good})")
        if key is None:
            self.stdout.write("MACs not checked: OMNI_AUDIT_KEY is not set")
        elif report.rows_before_key:
            self.stdout.write(f"{report.rows_before_key} leading rows have no MAC: written before the audit key "
                              f"was set (if it always was, they were rewritten)")

        path = heads or settings.OMNI_AUDIT_HEADS
        if not Path(path).exists():
            if heads is not None:
                raise CommandError(f"no heads file at {path}")
            self.stdout.write(f"no published heads at {path}: the chain's end is not anchored")
        else:
            checked = verify_heads(path, key=key)
            for problem in checked.problems or ():
                self.stderr.write(f"audit head MISMATCH: {problem}")
            if checked.ok:
                self.stdout.write(f"{checked.heads} published heads in {path} match the chain")
            broken = broken or not checked.ok
        if broken:
            raise SystemExit(1)
