#!/usr/bin/env python3
"""Verify an Omni audit export (``/audit/export.json``) with nothing but the Python standard library.

Usage: ``python verify_audit_export.py EXPORT.json [--complete] [--key-file FILE]``. Each row's hash
is recomputed from its own fields and ``prev_hash``; consecutive rows must link (a row's
``prev_hash`` is the hash of the row before it). A filtered export has gaps between its rows, which
are counted, not refused; ``--complete`` also demands an unbroken chain from the first row ever
written (64 zeros). ``--key-file`` names a file holding the audit key (``OMNI_AUDIT_KEY``; its
contents less surrounding whitespace): each row's ``mac`` must then be HMAC-SHA256(key, hash), and
once a row has one every later row must. Exit 0 when everything verifies, 1 naming the first bad row. The canonical form is in
docs/audit-log.md ("Verifying an export"); this file copies nothing from Omni and may be copied
on its own.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

GENESIS_HASH = "0" * 64
HASHED_FIELDS = (
    "at", "kind", "job_id", "job_name", "nodes_before", "nodes_after", "gpus_before", "gpus_after", "dp_before",
    "dp_after", "accum_before", "accum_after", "global_batch", "actor_user_id", "actor", "planner_run", "command",
    "refers_to_id", "reason", "outcome", "prev_hash",
)


def _number(value: int | float) -> int | float:
    # An integral float is hashed as the integer its shortest decimal spells (1e16 -> 10**16).
    if isinstance(value, float) and value.is_integer():
        return int(Decimal(repr(value)))
    return value


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    return _number(value)


def _at(text: str) -> str:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def canonical_text(row: dict[str, Any]) -> str:
    """The text that is hashed after ``prev_hash``: the hashed fields, keys sorted, no spaces."""
    missing = [name for name in HASHED_FIELDS if name not in row]
    if missing:
        raise ValueError(f"row {row.get('id')} lacks hashed fields {missing}")
    body = {name: _plain(row[name]) for name in HASHED_FIELDS}
    body["at"] = _at(row["at"])
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def row_hash(row: dict[str, Any]) -> str:
    return hashlib.sha256((row["prev_hash"] + canonical_text(row)).encode("utf-8")).hexdigest()


@dataclass
class Verdict:
    """What verifying an export found."""

    rows: int = 0
    gaps: int = 0
    rows_before_key: int = 0  # leading rows without a MAC (written before the key was set)
    first_bad_id: Any = None
    problem: str = ""

    @property
    def ok(self) -> bool:
        return self.first_bad_id is None


def mac_problem(row: dict[str, Any], key: bytes, keyed_before: bool) -> str:
    mac = row.get("mac") or ""
    if mac:
        expected = hmac.new(key, str(row["hash"]).encode("ascii"), hashlib.sha256).hexdigest()
        return "" if hmac.compare_digest(str(mac), expected) else \
            "its MAC does not match: rewritten by someone without the audit key"
    if keyed_before:
        return "it has no MAC though rows before it do: written or rewritten by someone without the audit key"
    return ""


def verify(rows: list[dict[str, Any]], *, complete: bool = False, key: bytes | None = None) -> Verdict:
    verdict = Verdict()
    previous: str | None = GENESIS_HASH if complete else None
    for row in rows:
        try:
            recomputed = row_hash(row)
        except (KeyError, TypeError, ValueError) as exc:
            verdict.first_bad_id, verdict.problem = row.get("id"), f"cannot be read: {exc}"
            return verdict
        if recomputed != row.get("hash"):
            verdict.first_bad_id, verdict.problem = row.get("id"), "its contents do not match its hash"
            return verdict
        if previous is not None and row["prev_hash"] != previous:
            if complete:
                verdict.first_bad_id = row.get("id")
                verdict.problem = "its prev_hash is not the hash of the row before it (a row is missing)"
                return verdict
            verdict.gaps += 1
        if key is not None:
            problem = mac_problem(row, key, keyed_before=verdict.rows > verdict.rows_before_key)
            if problem:
                verdict.first_bad_id, verdict.problem = row.get("id"), problem
                return verdict
            if not row.get("mac"):
                verdict.rows_before_key += 1
        previous = row["hash"]
        verdict.rows += 1
    return verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", help="the JSON file from /audit/export.json")
    parser.add_argument("--complete", action="store_true",
                        help="the export is the whole log: demand an unbroken chain from the first row")
    parser.add_argument("--key-file", help="a file holding the audit key: check every row's MAC too")
    args = parser.parse_args(argv)
    key = None
    if args.key_file:
        with open(args.key_file, encoding="utf-8") as handle:
            key = handle.read().strip().encode("utf-8")
    with open(args.export, encoding="utf-8") as handle:
        rows = json.load(handle)
    verdict = verify(rows, complete=args.complete, key=key)
    if not verdict.ok:
        print(f"audit export BROKEN at row {verdict.first_bad_id}: {verdict.problem} "
              f"({verdict.rows} rows verified before it)", file=sys.stderr)
        return 1
    gaps = f"; {verdict.gaps} gaps between rows (a filtered export)" if verdict.gaps else ""
    macs = ""
    if key is not None:
        macs = "; MACs match" + (f" ({verdict.rows_before_key} leading rows have none: written before the key)"
                                  if verdict.rows_before_key else "")
    print(f"audit export verified: {verdict.rows} rows recompute{gaps}{macs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
