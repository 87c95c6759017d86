"""``manage.py import_dcgm URL [URL ...]``: scrape dcgm-exporters into Omni's GPU samples."""

from __future__ import annotations

import time

from django.core.management.base import BaseCommand, CommandError, CommandParser

from telemetry.dcgm import fetch, import_text


def parse_node_map(text: str) -> dict[str, str]:
    """``host=node,host2=node2`` -> {host: node}."""
    mapping: dict[str, str] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        host, sep, node = pair.partition("=")
        if not sep or not host.strip() or not node.strip():
            raise CommandError(f"--node-map: expected HOST=NODE, got {pair!r}")
        mapping[host.strip()] = node.strip()
    return mapping


class Command(BaseCommand):
    help = "Scrape NVIDIA dcgm-exporter endpoints and store their GPU samples (docs/telemetry.md)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("urls", nargs="+", help="dcgm-exporter /metrics URLs")
        parser.add_argument("--node-map", default="", help="HOST=NODE pairs, comma-separated, when the "
                            "exporter's Hostname (or hostname) label differs from the Omni node name")
        parser.add_argument("--node", default=None, help="store every series under this node (one exporter "
                            "per node without Hostname labels)")
        parser.add_argument("--every-s", type=float, default=0.0, help="scrape repeatedly at this interval")
        parser.add_argument("--count", type=int, default=1, help="number of scrapes (with --every-s)")
        parser.add_argument("--timeout-s", type=float, default=10.0)

    def handle(self, *args, **options) -> None:
        node_map = parse_node_map(options["node_map"])
        count = max(1, options["count"])
        for round_index in range(count):
            started = time.time()
            for url in options["urls"]:
                try:
                    text = fetch(url, options["timeout_s"])
                except (OSError, ValueError) as exc:
                    self.stderr.write(f"{url}: scrape failed: {exc}")
                    continue
                # One source per exporter URL; the scrape time in ms is a rising sequence number.
                result = import_text(
                    text, source=f"dcgm:{url}"[:128], seq=int(started * 1000), node_map=node_map,
                    node_name=options["node"], scraped_at_s=started,
                )
                stored = sum(r.accepted for r in result.results.values())
                self.stdout.write(f"{url}: stored {stored} samples for {len(result.results)} nodes")
                for node, errors in result.rejected.items():
                    self.stderr.write(f"{url}: batch for {node} rejected: {errors}")
                if result.unknown_hosts:
                    self.stderr.write(f"{url}: no node for hosts {sorted(result.unknown_hosts)} (use --node-map)")
            if round_index + 1 < count and options["every_s"] > 0:
                time.sleep(max(0.0, started + options["every_s"] - time.time()))
