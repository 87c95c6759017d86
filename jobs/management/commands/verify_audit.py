"""``manage.py verify_audit``: walk the audit hash chain and name the first bad row."""

from __future__ import annotations

from django.core.management.base import BaseCommand

from jobs.audit import verify_chain


class Command(BaseCommand):
    help = "Verify the audit log's hash chain; exit 1 and name the first bad row if it is broken."

    def handle(self, *args, **options) -> None:
        report = verify_chain()
        if report.ok:
            self.stdout.write(f"audit chain intact: {report.rows_checked} rows verified"
                              + (f" (up to row {report.last_good_id})" if report.last_good_id else ""))
            return
        good = f"rows up to {report.last_good_id} verified" if report.last_good_id else "no row verified"
        self.stderr.write(f"audit chain BROKEN at row {report.first_bad_id}: {report.problem} ({good})")
        raise SystemExit(1)
