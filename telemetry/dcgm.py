"""Import GPU samples from NVIDIA dcgm-exporter's Prometheus text format.

Lets an existing GPU cluster feed Omni without our agent: ``manage.py import_dcgm URL`` scrapes
the exporter, maps each series' ``Hostname`` (``hostname`` in newer exporters) label to a Node
(``--node-map`` when names differ), and sends one batch per node through the same
``ingest_gpu_batch`` as the agents; DCGM's blank sentinels are skipped as "no reading".
Metrics read: DCGM_FI_DEV_GPU_UTIL (%), DCGM_FI_DEV_FB_USED (MiB), DCGM_FI_DEV_POWER_USAGE (W),
DCGM_FI_DEV_GPU_TEMP (C), DCGM_FI_DEV_XID_ERRORS (the last XID code; stored as 1 when non-zero,
since the exporter reports no count). See docs/telemetry.md.
"""

from __future__ import annotations

import logging
import math
import re
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

from jobs.models import Node
from telemetry.ingest import BatchRejected, IngestResult, ingest_gpu_batch

logger = logging.getLogger(__name__)

DCGM_FIELDS = {
    "DCGM_FI_DEV_GPU_UTIL": "util_pct",
    "DCGM_FI_DEV_FB_USED": "mem_used_bytes",
    "DCGM_FI_DEV_POWER_USAGE": "power_w",
    "DCGM_FI_DEV_GPU_TEMP": "temp_c",
    "DCGM_FI_DEV_XID_ERRORS": "xid_errors",
}
# The label naming the exporter's host: ``Hostname`` up to dcgm-exporter 3.x, ``hostname`` in
# later releases; the first non-empty one wins.
HOST_LABELS = ("Hostname", "hostname")
# DCGM's "no value" sentinels (dcgm_structs.h), which the exporter prints as numbers: blank,
# not found, not supported and not permissioned are BLANK + 0..3 (up to +15 reserved) for
# int32 (0x7ffffff0, 2147483632), int64 (0x7ffffffffffffff0, 9223372036854775792; e.g.
# 9223372036854775794 is "not supported") and fp64 (2**47 = 140737488355328.0). No field
# imported here can reach 2**47 honestly, so everything from there up is a sentinel.
DCGM_INT32_BLANK = 0x7FFFFFF0
DCGM_FP64_BLANK = 140737488355328.0
MIB = 1024 * 1024
MAX_BODY_BYTES = 32 * 1024 * 1024

_LINE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+(?P<ts>-?\d+))?\s*$"
)
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass(frozen=True)
class PromSample:
    """One line of the exposition format."""

    name: str
    labels: dict[str, str]
    value: float
    timestamp_ms: int | None


def parse_exposition(text: str) -> Iterator[PromSample]:
    """Parse Prometheus text format (0.0.4); comments and malformed lines are skipped."""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            logger.debug("dcgm: skipped unparsable line %r", line[:200])
            continue
        labels: dict[str, str] = {}
        raw = match["labels"] or ""
        position = 0
        while position < len(raw):
            label = _LABEL.match(raw, position)
            if label is None:
                break
            labels[label[1]] = re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m[0]], label[2])
            position = label.end()
        try:
            value = float(match["value"])
        except ValueError:
            continue
        yield PromSample(match["name"], labels, value, int(match["ts"]) if match["ts"] else None)


def is_dcgm_blank(value: float) -> bool:
    """True for DCGM's sentinels that mean "no value" (see DCGM_INT32_BLANK)."""
    return value >= DCGM_FP64_BLANK or DCGM_INT32_BLANK <= value <= DCGM_INT32_BLANK + 15


def host_of(labels: dict[str, str]) -> str:
    """The exporter's host name from a series' labels, or ``""``."""
    return next((labels[name] for name in HOST_LABELS if labels.get(name)), "")


@dataclass
class ScrapeResult:
    """What one scrape produced: batches per node, and hosts with no matching node."""

    results: dict[str, IngestResult] = field(default_factory=dict)
    rejected: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    unknown_hosts: set[str] = field(default_factory=set)


def samples_by_host(text: str, scraped_at_s: float) -> dict[str, dict[tuple[int, float], dict]]:
    """Group the DCGM series into GPU samples: host -> (gpu, time) -> sample fields."""
    hosts: dict[str, dict[tuple[int, float], dict]] = {}
    for sample in parse_exposition(text):
        field_name = DCGM_FIELDS.get(sample.name)
        if field_name is None or "gpu" not in sample.labels or not math.isfinite(sample.value):
            continue
        if is_dcgm_blank(sample.value):
            continue  # the exporter has no reading (a field this GPU does not support, say)
        try:
            gpu = int(sample.labels["gpu"])
        except ValueError:
            continue
        host = host_of(sample.labels)
        at_s = sample.timestamp_ms / 1000.0 if sample.timestamp_ms is not None else scraped_at_s
        row = hosts.setdefault(host, {}).setdefault((gpu, at_s), {"gpu": gpu, "at": at_s})
        if field_name == "mem_used_bytes":
            row[field_name] = int(sample.value) * MIB
        elif field_name == "xid_errors":
            row[field_name] = 1 if sample.value else 0
        else:
            row[field_name] = float(sample.value)
    return hosts


def import_text(text: str, *, source: str, seq: int, node_map: dict[str, str] | None = None,
                node_name: str | None = None, scraped_at_s: float | None = None) -> ScrapeResult:
    """Ingest one exposition: one batch per node, ``seq`` shared (sources are per node)."""
    scraped_at_s = time.time() if scraped_at_s is None else scraped_at_s
    node_map = node_map or {}
    result = ScrapeResult()
    grouped = samples_by_host(text, scraped_at_s)
    names = {host: node_name or node_map.get(host, host) for host in grouped}
    nodes = {node.name: node for node in Node.objects.filter(name__in=set(names.values()))}
    for host, rows in grouped.items():
        node = nodes.get(names[host])
        if node is None:
            result.unknown_hosts.add(host or "<no Hostname or hostname label>")
            continue
        # Rows missing utilisation or memory (an exporter configured without them) are skipped.
        samples = [row for row in rows.values() if "util_pct" in row and "mem_used_bytes" in row]
        if not samples:
            continue
        try:
            result.results[node.name] = ingest_gpu_batch(node, {"source": source, "seq": seq, "samples": samples})
        except BatchRejected as exc:
            result.rejected[node.name] = exc.errors
    return result


def fetch(url: str, timeout_s: float = 10.0) -> str:
    """GET the exporter's /metrics text."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"expected an http(s) URL, got {url!r}")
    request = urllib.request.Request(url, headers={"Accept": "text/plain"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 - scheme checked
        return response.read(MAX_BODY_BYTES).decode("utf-8", errors="replace")
