"""Benchmark of telemetry ingestion, freshness, queries and memory.

``python -m bench.ingest --json`` prints ONE JSON object. Against PostgreSQL from
``DATABASE_URL`` (or postgres://postgres@127.0.0.1:5432); it creates its own scratch database
and drops it afterwards. Phases, all in one process and one run:

1. **raw COPY**: the benchmark's GPU samples, already in binary COPY form, copied batch by batch
   into ``telemetry_gpusample`` (one transaction per batch, same commit settings as ingestion,
   under a shadow node id so the two copies never collide): ``copy_samples_per_s``.
2. **project path**: the *same* samples, as the decoded JSON batches an agent sends, through
   ``telemetry.ingest.ingest_gpu_batch`` (validation, de-duplication, partition check, binary
   COPY, source bookkeeping, after-commit live emission): ``samples_per_s`` (time inside ingest
   calls; building the dicts is the sender's work, included in ``wall_samples_per_s``), and
   ``ratio`` = samples_per_s / copy_samples_per_s. Phases 1 and 2 alternate batch by batch.
3. **soak**: ingestion paced at ``--soak-rate`` samples/s (that many GPUs at 1 Hz, 8 per node,
   each node sending its last 125 s at once) for ``--soak-s`` seconds, sampling the
   process RSS each second (``rss_mb_*``, ``rss_growth_mb``); meanwhile a probe thread on its own
   connection measures **freshness**: from a batch being handed to ingestion to its newest
   sample being visible through ``telemetry.queries.latest_gpu_samples`` (``freshness_p95_s``).
4. **rollups and query**: 64 more GPUs (8 nodes) report at 1 Hz for ``--query-recent-s`` (raw,
   through the project path); the real rollup passes run over everything stored (``rollup_s``);
   7 days of synthetic 1-minute/1-hour rollups for those 64 GPUs are seeded before their raw
   data; then a 7-day, 64-GPU ``gpu_utilisation_series`` at ``max_points=2000``
   (``query_ms_p50``/``query_ms_p95``, server time) and the 7-day ``cluster_utilisation``.

Figures and how to read them: docs/telemetry.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import queue
import statistics
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit, urlunsplit

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/postgres"
NODES = 64
GPUS_PER_NODE = 8
QUERY_NODES = 8  # 64 GPUs
SAMPLE_INTERVAL_S = 0.1  # bench GPUs report at 10 Hz so the samples fit inside raw retention


def _rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class BatchMaker:
    """Builds the batches an agent on each node would send: ``batch // 8`` readings of each of
    its 8 GPUs, ``interval_s`` apart, walking forward (or back) in time per node so every batch
    has fresh (node, gpu, time) keys."""

    def __init__(self, nodes: list, batch: int, start_s: float, interval_s: float, *, forward: bool,
                 source: str = "bench"):
        import numpy as np

        self.nodes = nodes
        self.per_gpu = batch // GPUS_PER_NODE
        self.interval_s = interval_s
        self.step_s = interval_s if forward else -interval_s
        self.cursor_s = {node.pk: start_s for node in nodes}
        self.seq = {node.pk: 0 for node in nodes}
        self.source = source
        rng = np.random.default_rng(7)
        self.util = rng.uniform(0, 100, size=8192).round(1).tolist()
        self.mem = rng.integers(1 << 30, 80 << 30, size=8192).tolist()
        self.power = rng.uniform(80, 700, size=8192).round(1).tolist()
        self.temp = rng.uniform(30, 85, size=8192).round(1).tolist()
        self.turn = 0

    def next(self) -> tuple[object, dict]:
        node = self.nodes[self.turn % len(self.nodes)]
        self.turn += 1
        first_s, step_s = self.cursor_s[node.pk], self.step_s
        self.cursor_s[node.pk] = first_s + self.per_gpu * step_s
        offset = (self.turn * 131) % 4000
        util, mem, power, temp = self.util, self.mem, self.power, self.temp
        samples = [
            {"gpu": g, "at": first_s + k * step_s, "util_pct": util[offset + k + g], "mem_used_bytes": mem[offset + g],
             "power_w": power[offset + k], "temp_c": temp[offset + g], "xid_errors": 0}
            for k in range(self.per_gpu) for g in range(GPUS_PER_NODE)
        ]
        seq = self.seq[node.pk]
        self.seq[node.pk] = seq + 1
        return node, {"source": f"{self.source}-{node.name}", "seq": seq, "samples": samples}

    def oldest_s(self) -> float:
        return min(self.cursor_s.values())


def _scratch_database(base_url: str) -> tuple[str, str]:
    """Create a scratch database next to ``base_url``'s; returns (its URL, its name)."""
    import psycopg

    parts = urlsplit(base_url)
    name = f"omni_bench_ingest_{os.getpid()}"
    admin = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    return urlunsplit(parts._replace(path=f"/{name}")), name


def _drop_database(base_url: str, name: str) -> None:
    import psycopg

    admin = urlunsplit(urlsplit(base_url)._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _setup_django(url: str) -> None:
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("SECRET_KEY", "bench-ingest-not-secret")
    os.environ.pop("REDIS_URL", None)  # in-memory channel layer: the bench measures the database path
    os.environ["OMNI_INPROCESS_LOOP"] = "0"
    os.environ["DJANGO_SETTINGS_MODULE"] = "omniweb.settings"
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def _nodes() -> list:
    from jobs.models import Node

    Node.objects.bulk_create(
        Node(name=f"bench-r{i // 16}n{i % 16:02d}", rack=f"r{i // 16}", switch=f"r{i // 16}s0", gpu_count=GPUS_PER_NODE)
        for i in range(NODES)
    )
    return list(Node.objects.order_by("pk"))


def _prepare_partitions(oldest_s: float, newest_s: float) -> None:
    from django.db import transaction

    from telemetry.partitions import ensure_partitions

    with transaction.atomic():
        ensure_partitions(
            "telemetry_gpusample", datetime.fromtimestamp(oldest_s, UTC), datetime.fromtimestamp(newest_s, UTC)
        )


SHADOW_NODE_OFFSET = 1_000_000_000


def _copy_payload(node, batch: dict) -> bytes:
    """The batch's rows in binary COPY form, under a shadow node id so they never collide with
    the project path's copy of the same rows (built outside the timed region)."""
    from telemetry.copy import binary_payload
    from telemetry.ingest import GPU_COLUMNS, _Errors, validate_gpu_samples

    rows = validate_gpu_samples(node, batch["samples"], _Errors(), time.time())
    rows.values["node_id"] = rows.values["node_id"] + SHADOW_NODE_OFFSET
    return binary_payload(GPU_COLUMNS, rows.values, rows.nulls)


def _raw_copy(payload: bytes) -> float:
    """Seconds to COPY one payload in its own transaction, with ingestion's commit settings."""
    from django.conf import settings
    from django.db import connection, transaction

    from telemetry.ingest import GPU_COLUMNS

    names = ", ".join(name for name, _ in GPU_COLUMNS)
    started = time.perf_counter()
    with transaction.atomic(), connection.cursor() as wrapper:
        if settings.OMNI_TELEMETRY_ASYNC_COMMIT:
            wrapper.execute("SET LOCAL synchronous_commit TO off")
        with wrapper.cursor.copy(f"COPY telemetry_gpusample ({names}) FROM STDIN (FORMAT BINARY)") as copy:
            copy.write(payload)
    return time.perf_counter() - started


def _truncate() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE telemetry_gpusample")
        cursor.execute("TRUNCATE telemetry_telemetrysource")


class FreshnessProbe(threading.Thread):
    """On its own connection, waits until each handed-over batch is visible to the queries."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="freshness-probe")
        self.inbox: queue.Queue = queue.Queue(maxsize=64)
        self.delays_s: list[float] = []
        self.timeouts = 0

    def run(self) -> None:
        from django.db import connection

        from telemetry.queries import latest_gpu_samples

        while True:
            item = self.inbox.get()
            if item is None:
                break
            handed_s, node_id, newest_s = item
            while True:
                # A wide window: if ingestion falls behind the soak rate, data lags the clock.
                latest = latest_gpu_samples(node_ids=[node_id], within_s=3600.0)
                seen = max((v["at"].timestamp() for v in latest.values()), default=0.0)
                if seen >= newest_s - 1e-6:
                    self.delays_s.append(time.perf_counter() - handed_s)
                    break
                if time.perf_counter() - handed_s > 30:
                    self.timeouts += 1
                    break
                time.sleep(0.01)
        connection.close()


def _soak(batch: int, seconds: float, rate: float, probe_every: int) -> dict:
    """Real-time ingestion at ``rate`` samples/s from ``rate`` GPUs reporting at 1 Hz."""
    # A cluster the size of the rate: every GPU reports at 1 Hz, each node sends its last
    # ``batch / 8`` seconds at once, and the cluster cycles in ``batch / 8`` seconds.
    from jobs.models import Node
    from telemetry.ingest import ingest_gpu_batch

    count = max(1, round(rate / GPUS_PER_NODE))
    Node.objects.bulk_create(
        Node(name=f"soak-n{i:05d}", rack=f"s{i // 256}", switch=f"s{i // 256}-{i // 32}", gpu_count=GPUS_PER_NODE)
        for i in range(count)
    )
    nodes = list(Node.objects.filter(name__startswith="soak-n").order_by("pk"))
    maker = BatchMaker(nodes, batch, time.time() - batch // GPUS_PER_NODE, 1.0, forward=True, source="live")

    probe = FreshnessProbe()
    probe.start()
    rss: list[float] = []
    started = time.perf_counter()
    next_rss = started
    sent = 0
    batches = 0
    while True:
        now = time.perf_counter()
        if now - started >= seconds:
            break
        if now >= next_rss:
            rss.append(_rss_mb())
            next_rss += 1.0
        due = started + sent / rate
        if now < due:
            time.sleep(min(0.05, due - now))
            continue
        node, batch = maker.next()
        handed = time.perf_counter()
        result = ingest_gpu_batch(node, batch)
        sent += result.accepted
        batches += 1
        if batches % probe_every == 0:
            try:
                probe.inbox.put_nowait((handed, node.pk, result.newest_at.timestamp()))
            except queue.Full:
                pass
    elapsed = time.perf_counter() - started
    probe.inbox.put(None)
    probe.join(60)
    rss.append(_rss_mb())
    warm = rss[max(1, len(rss) // 10):] or rss
    return {
        "soak_s": round(elapsed, 1),
        "soak_samples_per_s": round(sent / elapsed),
        "freshness_p50_s": round(_percentile(probe.delays_s, 0.5), 4),
        "freshness_p95_s": round(_percentile(probe.delays_s, 0.95), 4),
        "freshness_max_s": round(max(probe.delays_s, default=float("nan")), 4),
        "freshness_probes": len(probe.delays_s),
        "freshness_timeouts": probe.timeouts,
        "rss_mb_start": round(warm[0], 1),
        "rss_mb_end": round(rss[-1], 1),
        "rss_mb_max": round(max(rss), 1),
        "rss_growth_mb": round(rss[-1] - warm[0], 1),
        # once a minute: the first minutes include the per-node caches filling (one entry per
        # node and source, bounded by the cluster), after that the line should be flat
        "rss_mb_by_minute": [round(value, 1) for value in rss[::60]],
    }


def _seed_rollups(nodes: list, before: datetime, days: float) -> int:
    """Synthetic 1-minute and 1-hour rollups for ``nodes`` over ``days`` ending at ``before``."""
    import numpy as np
    from django.db import connection, transaction

    from telemetry.copy import binary_payload, timestamptz_from_epoch_s
    from telemetry.partitions import ensure_partitions

    columns = (
        ("node_id", "bigint"), ("gpu_index", "smallint"), ("bucket", "timestamptz"), ("samples", "integer"),
        ("util_mean_pct", "real"), ("util_max_pct", "real"), ("util_p95_pct", "real"), ("mem_mean_bytes", "bigint"),
        ("mem_max_bytes", "bigint"), ("power_mean_w", "real"), ("power_max_w", "real"), ("temp_mean_c", "real"),
        ("temp_max_c", "real"), ("xid_errors_max", "integer"),
    )
    rng = np.random.default_rng(3)
    written = 0
    for table, step_s in (("telemetry_gpuminute", 60), ("telemetry_gpuhour", 3600)):
        end_s = before.timestamp() // step_s * step_s
        start_s = end_s - days * 86400
        buckets = np.arange(start_s, end_s, step_s)
        keys = [(node.pk, g) for node in nodes for g in range(GPUS_PER_NODE)]
        n = len(buckets) * len(keys)
        util = rng.uniform(0, 100, n).astype(np.float32)
        values = {
            "node_id": np.repeat(np.array([k[0] for k in keys], dtype=np.int64), len(buckets)),
            "gpu_index": np.repeat(np.array([k[1] for k in keys], dtype=np.int16), len(buckets)),
            "bucket": np.tile(timestamptz_from_epoch_s(buckets.astype(np.float64)), len(keys)),
            "samples": np.full(n, step_s, dtype=np.int32),
            "util_mean_pct": util, "util_max_pct": np.minimum(util + 10, 100), "util_p95_pct": np.minimum(util + 8, 100),
            "mem_mean_bytes": np.full(n, 40 << 30, dtype=np.int64), "mem_max_bytes": np.full(n, 41 << 30, dtype=np.int64),
            "power_mean_w": np.full(n, 500, dtype=np.float32), "power_max_w": np.full(n, 650, dtype=np.float32),
            "temp_mean_c": np.full(n, 60, dtype=np.float32), "temp_max_c": np.full(n, 70, dtype=np.float32),
            "xid_errors_max": np.zeros(n, dtype=np.int32),
        }
        names = ", ".join(c for c, _ in columns)
        with transaction.atomic():
            ensure_partitions(table, datetime.fromtimestamp(start_s, UTC), datetime.fromtimestamp(end_s, UTC))
            with connection.cursor() as wrapper, wrapper.cursor.copy(
                f"COPY {table} ({names}) FROM STDIN (FORMAT BINARY)"
            ) as copy:
                copy.write(binary_payload(columns, values))
        written += n
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE telemetry_gpuminute")
        cursor.execute("ANALYZE telemetry_gpuhour")
    return written


def _query_phase(repeats: int, recent_s: float) -> dict:
    """64 GPUs (8 dedicated nodes) reporting at 1 Hz: ``recent_s`` of raw samples through the
    project path, the real rollup passes, 7 days of older rollups seeded, then the chart."""
    import numpy as np
    from django.db import connection

    from jobs.models import Node
    from telemetry import queries, rollups
    from telemetry.ingest import ingest_gpu_batch
    from telemetry.models import RollupWatermark

    nodes = [Node.objects.create(name=f"bench-query-n{i}", rack="rq", switch="rq-s0", gpu_count=GPUS_PER_NODE)
             for i in range(QUERY_NODES)]
    now_s = time.time()
    oldest_raw_s = now_s - recent_s
    util = np.random.default_rng(5).uniform(0, 100, 4096).round(1).tolist()
    per_batch_s = 125  # 125 s of 8 GPUs at 1 Hz = 1000 samples
    for node in nodes:
        for seq, first_s in enumerate(np.arange(oldest_raw_s, now_s - 1, per_batch_s).tolist()):
            samples = [{"gpu": g, "at": first_s + k, "util_pct": util[(k * 8 + g) % 4096], "mem_used_bytes": 1 << 35}
                       for k in range(per_batch_s) if first_s + k < now_s for g in range(GPUS_PER_NODE)]
            ingest_gpu_batch(node, {"source": "query-agent", "seq": seq, "samples": samples})
    started = time.perf_counter()
    passes = 0
    current_minute = datetime.now(UTC).replace(second=0, microsecond=0)
    while passes < 40:
        passes += 1
        rollups.roll_up()
        mark = RollupWatermark.objects.filter(level="gpu-minute").values_list("rolled_until", flat=True).first()
        if mark is not None and mark >= current_minute:
            break
    rollup_s = time.perf_counter() - started
    marks = dict(RollupWatermark.objects.values_list("level", "rolled_until"))
    before = datetime.fromtimestamp(oldest_raw_s, UTC).replace(minute=0, second=0, microsecond=0)
    seeded = _seed_rollups(nodes, before, days=7)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE telemetry_gpusample")
    end = datetime.now(UTC)
    start = end - timedelta(days=7)
    node_ids = [node.pk for node in nodes]
    timings, cluster_timings = [], []
    result = {}
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = queries.gpu_utilisation_series(start=start, end=end, max_points=2000, node_ids=node_ids)
        timings.append((time.perf_counter() - t0) * 1000)
    for _ in range(max(3, repeats // 4)):
        t0 = time.perf_counter()
        queries.cluster_utilisation(start=start, end=end, max_points=2000)
        cluster_timings.append((time.perf_counter() - t0) * 1000)
    traces = result.get("traces", {})
    return {
        "rollup_s": round(rollup_s, 2),
        "rollup_passes": passes,
        "rollup_watermark_minute": marks.get("gpu-minute").isoformat() if marks.get("gpu-minute") else None,
        "seeded_rollup_rows": seeded,
        "query_level": result.get("level"),
        "query_bucket_s": result.get("bucket_s"),
        "query_traces": len(traces),
        "query_points_per_trace_max": max((len(t["t"]) for t in traces.values()), default=0),
        "query_ms_p50": round(statistics.median(timings), 1),
        "query_ms_p95": round(_percentile(timings, 0.95), 1),
        "query_ms_min": round(min(timings), 1),
        "cluster_query_ms_p50": round(statistics.median(cluster_timings), 1),
    }


def run(args: argparse.Namespace) -> dict:
    from django.conf import settings
    from django.db import connection

    from telemetry.ingest import ingest_gpu_batch

    load_start = round(os.getloadavg()[0], 2)
    nodes = _nodes()
    # The throughput phases walk back in time from a minute ago; the soak then runs in real time.
    newest_s = time.time() - 60
    oldest_s = newest_s - args.samples / (NODES * GPUS_PER_NODE) * SAMPLE_INTERVAL_S - 60
    if time.time() - oldest_s > settings.OMNI_TELEMETRY_RAW_RETENTION_H * 3600 - 600:
        raise SystemExit("bench: --samples too large to fit in raw retention at 10 Hz per GPU")
    _prepare_partitions(oldest_s, time.time() + args.soak_s + 600)

    maker = BatchMaker(nodes, args.batch, newest_s, SAMPLE_INTERVAL_S, forward=False)
    count = max(1, args.samples // args.batch)
    samples = 0
    build_s = copy_s = ingest_s = 0.0
    gc.collect()
    # 1 and 2, interleaved batch by batch (alternating which goes first) so that the table's
    # growth and any noise from other processes hit both the same way.
    for index in range(count):
        t0 = time.perf_counter()
        node, batch = maker.next()
        build_s += time.perf_counter() - t0
        payload = _copy_payload(node, batch)
        samples += len(batch["samples"])
        if index % 2:
            copy_s += _raw_copy(payload)
        t0 = time.perf_counter()
        ingest_gpu_batch(node, batch)
        ingest_s += time.perf_counter() - t0
        if not index % 2:
            copy_s += _raw_copy(payload)
        del payload, batch
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM telemetry_gpusample")
        stored = cursor.fetchone()[0]
    _truncate()  # the soak starts from an empty table; rollups then cover the soak's samples
    gc.collect()
    # 3. soak in real time at the target rate, with the freshness probe and RSS samples
    soak = _soak(args.batch, args.soak_s, args.soak_rate, args.probe_every)
    # 4. rollups and the 7-day query
    query = _query_phase(args.query_repeats, args.query_recent_s)
    copy_rate = samples / copy_s
    project_rate = samples / ingest_s
    return {
        "samples_per_s": round(project_rate),
        "copy_samples_per_s": round(copy_rate),
        "ratio": round(project_rate / copy_rate, 3),
        "wall_samples_per_s": round(samples / (ingest_s + build_s)),
        "samples": samples,
        "batch_samples": args.batch,
        "batches": count,
        "gpus": NODES * GPUS_PER_NODE,
        "rows_stored": stored,  # both copies of the rows (project path + raw COPY)
        **soak,
        **query,
        "async_commit": settings.OMNI_TELEMETRY_ASYNC_COMMIT,
        "cpus": os.cpu_count(),
        # Other processes share these cores; a load well above the core count slows every figure.
        "load_avg_1m_start": load_start,
        "load_avg_1m_end": round(os.getloadavg()[0], 2),
        "postgres_version": connection.cursor().connection.info.server_version,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object (the only output)")
    parser.add_argument("--samples", type=int, default=1_000_000, help="samples in the COPY and project phases")
    parser.add_argument("--batch", type=int, default=1000, help="samples per batch (multiple of 8)")
    parser.add_argument("--soak-s", type=float, default=20.0, help="seconds of paced ingestion (600 for memory)")
    parser.add_argument("--soak-rate", type=float, default=50_000.0, help="samples per second during the soak")
    parser.add_argument("--probe-every", type=int, default=10, help="probe freshness every N batches")
    parser.add_argument("--query-repeats", type=int, default=20)
    parser.add_argument("--query-recent-s", type=float, default=3600.0,
                        help="seconds of 1 Hz raw samples behind the 7-day chart (the rest is seeded rollups)")
    parser.add_argument("--database-url", default=None, help="PostgreSQL server (default DATABASE_URL or local)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch database")
    args = parser.parse_args(argv)
    base = args.database_url or os.environ.get("DATABASE_URL") or DEFAULT_URL
    if not base.startswith(("postgres://", "postgresql://")):
        raise SystemExit("bench.ingest needs PostgreSQL (DATABASE_URL=postgres://...)")
    url, name = _scratch_database(base)
    try:
        _setup_django(url)
        result = run(args)
    finally:
        from django.db import connections

        connections.close_all()
        if not args.keep:
            _drop_database(base, name)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:32} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
