"""Benchmark of the live pages: job page server time and WebSocket fan-out.

``python -m bench.live --json`` prints one JSON object with at least ``page_ms_p95``,
``fanout_ms_p50`` and ``fanout_ms_p95``:

* **page**: a job holding 64 GPUs (8 nodes x 8) with a week of telemetry history (1-minute
  rollups for 7 days, hourly rollups, raw samples for the last hour), rendered with
  ``?range=7d`` through Django's full request path in this process (server time, no network);
* **draw**: with Chromium installed, navigation start to the 7-day heat strip drawn
  (``browser_draw_ms_p50``, Plotly.js cached);
* **fan-out**: 200 WebSocket clients signed in and subscribed to the job on a real ASGI server
  (``manage.py serve`` on 127.0.0.1); one GPU sample at a time is POSTed to the real ingestion
  endpoint (``/api/telemetry/gpu``, agent token); the figure is the time from the POST until
  *every* client has received the sample (so it includes ingestion, commit, the channel layer
  and 200 sends). Samples are spaced beyond the live throttles so none waits on a throttle.

By default it runs on a throw-away embedded database (SQLite); ``--database-url`` (or
``DATABASE_URL``) runs it against PostgreSQL (a database it creates and drops). See
docs/live-ui.md for the figures and how to read them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (NaN for no values)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- data ----------------------------------------------------------------------------------------


def seed_cluster(gpus: int = 64, gpus_per_node: int = 8):
    """Users, nodes and one regular job holding every GPU, built through the real actions."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group

    from jobs import actions
    from jobs.models import Node
    from jobs.roles import RESEARCHER

    user_model = get_user_model()
    researcher, _ = user_model.objects.get_or_create(username="bench-researcher")
    researcher.groups.add(Group.objects.get(name=RESEARCHER))
    nodes_needed = gpus // gpus_per_node
    Node.objects.bulk_create(
        Node(name=f"b0s{i // 4}n{i % 4}", rack="b0", switch=f"b0s{i // 4}", gpu_count=gpus_per_node)
        for i in range(nodes_needed)
    )
    nodes = list(Node.objects.filter(rack="b0").order_by("name"))
    job = actions.submit_job(
        researcher, name="bench-vlm", priority="regular", tp=1, pp=1, dp=gpus, dp_min=gpus // 2, dp_max=gpus,
        global_batch=gpus * 16, micro_batch=4, total_steps=100_000, step_s=2.0,
    )
    job = actions.place_job(
        job, [(node, i) for node in nodes for i in range(gpus_per_node)], actor="bench",
        reason={"rule": "bench", "text": f"Placed on {gpus} GPUs for the benchmark.", "inputs": {}},
    )
    return researcher, nodes, job


def _insert(table: str, columns: list[str], rows: list[tuple]) -> None:
    from django.db import connection

    if not rows:
        return
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            with cursor.cursor.copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN") as copy:
                for row in rows:
                    copy.write_row(row)
        else:
            placeholders = ", ".join(["%s"] * len(columns))
            cursor.executemany(f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({placeholders})", rows)


def backdate_holding(job, since: datetime) -> None:
    """Take ``job`` to have held its current GPUs since ``since``: its allocations and their open
    spans move back, so telemetry seeded from then on shows on its charts."""
    from django.db import transaction

    from jobs.models import Allocation, AllocationSpan

    with transaction.atomic():
        Allocation.objects.filter(job=job).update(since=since)
        AllocationSpan.objects.filter(job=job, ended_at__isnull=True).update(started_at=since)


def seed_history(job, nodes, days: int, now: datetime) -> dict[str, int]:
    """A week of telemetry for ``job``'s GPUs: minute and hour rollups, the last hour raw. The
    job is taken to have held its GPUs since the history starts (a job's charts show each GPU
    only over the time it held it)."""
    import math

    from django.db import connection, transaction

    from telemetry.models import RollupWatermark
    from telemetry.partitions import ensure_partitions

    start = (now - timedelta(days=days)).replace(second=0, microsecond=0)
    end = now.replace(second=0, microsecond=0)
    backdate_holding(job, start)
    adapt = (lambda v: v) if connection.vendor == "postgresql" else connection.ops.adapt_datetimefield_value
    for table in ("telemetry_gpusample", "telemetry_gpuminute", "telemetry_gpuhour", "telemetry_steprecord",
                  "telemetry_stepminute", "telemetry_stephour"):
        ensure_partitions(table, start, now + timedelta(hours=1))
    counts = {"gpu_minute": 0, "gpu_hour": 0, "gpu_raw": 0, "step_minute": 0, "step_hour": 0}
    gpu_keys = [(node.pk, i) for node in nodes for i in range(node.gpu_count)]
    minutes = int((end - start).total_seconds() // 60)
    with transaction.atomic():
        gpu_cols = ["node_id", "gpu_index", "bucket", "samples", "util_mean_pct", "util_max_pct", "mem_mean_bytes",
                    "mem_max_bytes", "xid_errors_max"]
        batch: list[tuple] = []
        for m in range(minutes):
            bucket = start + timedelta(minutes=m)
            phase = math.sin(m / 90.0)
            stamp = adapt(bucket)
            for k, (node_id, gpu) in enumerate(gpu_keys):
                util = 78 + 14 * phase + (k % 7) - (25 if m % 240 < 6 else 0)
                batch.append((node_id, gpu, stamp, 6, util, min(util + 6, 100), 60_000_000_000, 64_000_000_000, 0))
            if len(batch) >= 50_000:
                _insert("telemetry_gpuminute", gpu_cols, batch)
                counts["gpu_minute"] += len(batch)
                batch = []
        _insert("telemetry_gpuminute", gpu_cols, batch)
        counts["gpu_minute"] += len(batch)
        hours = [(start + timedelta(hours=h)) for h in range(days * 24)]
        hour_rows = [(node_id, gpu, adapt(h), 360, 80.0, 97.0, 60_000_000_000, 64_000_000_000, 0)
                     for h in hours for node_id, gpu in gpu_keys]
        _insert("telemetry_gpuhour", gpu_cols, hour_rows)
        counts["gpu_hour"] = len(hour_rows)
        step_cols = ["job_id", "bucket", "records", "ranks", "step_max", "step_s_mean", "step_s_max",
                     "tokens_text_sum", "tokens_image_sum", "tokens_video_sum", "tokens_audio_sum"]
        step_rows = []
        for m in range(minutes):
            records = 30 * 64
            step_rows.append((job.pk, adapt(start + timedelta(minutes=m)), records, 64, m * 30, 2.0 + 0.1 * math.sin(m / 50),
                              2.3, 900 * records, 2400 * records, 600 * records if m % 120 < 60 else 0, 0))
        _insert("telemetry_stepminute", step_cols, step_rows)
        counts["step_minute"] = len(step_rows)
        records = 30 * 64 * 60
        step_hours = [(job.pk, adapt(h), records, 64, int((h - start).total_seconds() // 2), 2.0, 2.4,
                       900 * records, 2400 * records, 300 * records, 0) for h in hours]
        _insert("telemetry_stephour", step_cols, step_hours)
        counts["step_hour"] = len(step_hours)
        raw_cols = ["node_id", "gpu_index", "at", "util_pct", "mem_used_bytes", "xid_errors"]
        raw = [(node_id, gpu, adapt(end - timedelta(seconds=s)), 80.0 + (s % 11), 60_000_000_000, 0)
               for s in range(0, 3600, 10) for node_id, gpu in gpu_keys]
        _insert("telemetry_gpusample", raw_cols, raw)
        counts["gpu_raw"] = len(raw)
        for level in ("gpu-minute", "gpu-hour", "step-minute", "step-hour"):
            until = end if level.endswith("minute") else end.replace(minute=0)
            RollupWatermark.objects.update_or_create(level=level, defaults={"rolled_until": until})
    return counts


# -- measurements ----------------------------------------------------------------------------------


def measure_page(user, job, rounds: int, range_key: str) -> list[float]:
    """Server time of the job page (full Django request path, in process), in ms."""
    from django.test import Client

    client = Client()
    client.force_login(user)
    url = f"/jobs/{job.pk}/?range={range_key}"
    for _ in range(2):
        assert client.get(url).status_code == 200
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        response = client.get(url)
        times.append((time.perf_counter() - started) * 1000)
        assert response.status_code == 200
    return times


async def _fanout(port: int, cookie: str, job_id: int, node_name: str, token: str, clients: int,
                  samples: int, spacing_s: float) -> dict[str, Any]:
    from websockets.asyncio.client import connect

    url = f"ws://127.0.0.1:{port}/ws/live/"
    headers = {"Cookie": cookie, "Origin": f"http://127.0.0.1:{port}"}
    sockets = []
    for _ in range(clients):
        ws = await connect(url, additional_headers=headers, max_queue=None, open_timeout=20)
        await ws.recv()  # hello
        await ws.send(json.dumps({"action": "subscribe", "stream": "job", "id": job_id}))
        reply = json.loads(await ws.recv())
        if reply.get("type") != "subscribed":
            raise RuntimeError(f"subscribe refused: {reply}")
        sockets.append(ws)

    arrivals: dict[float, list[float]] = {}

    async def listen(ws) -> None:
        async for raw in ws:
            message = json.loads(raw)
            if message.get("event") != "gpu_samples":
                continue
            now = time.perf_counter()
            for payload in message.get("batch", []):
                for point in payload.get("points", []):
                    arrivals.setdefault(round(point["at"], 3), []).append(now)

    listeners = [asyncio.create_task(listen(ws)) for ws in sockets]

    def post(at: float) -> float:
        body = json.dumps({"source": "bench-live", "seq": int(at * 1000),
                           "samples": [{"gpu": 0, "at": at, "util_pct": 91.0, "mem_used_bytes": 1}]}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/api/telemetry/gpu", data=body, method="POST",
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}", "X-Omni-Node": node_name},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()
        return time.perf_counter()

    all_ms, first_ms, spread_ms, accept_ms, missing = [], [], [], [], 0
    for _ in range(samples):
        at = round(time.time(), 3)
        started = time.perf_counter()
        accepted = await asyncio.to_thread(post, at)
        accept_ms.append((accepted - started) * 1000)
        deadline = time.perf_counter() + 5
        while len(arrivals.get(at, [])) < clients and time.perf_counter() < deadline:
            await asyncio.sleep(0.002)
        got = arrivals.get(at, [])
        if len(got) < clients:
            missing += clients - len(got)
        if got:
            all_ms.append((max(got) - started) * 1000)
            first_ms.append((min(got) - started) * 1000)
            spread_ms.append((max(got) - min(got)) * 1000)
        await asyncio.sleep(spacing_s)
    for task in listeners:
        task.cancel()
    for ws in sockets:
        await ws.close()
    return {"all_ms": all_ms, "first_ms": first_ms, "spread_ms": spread_ms, "accept_ms": accept_ms,
            "missing": missing}


def measure_browser_draw(port: int, cookie: str, job_id: int, rounds: int = 3) -> list[float] | None:
    """Navigation start to the 7-day charts drawn, in Chromium (None when it is not installed or
    the server does not serve /static/, as in production mode)."""
    chromium = "/usr/bin/chromium"
    if not os.path.exists(chromium):
        return None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    try:  # production mode leaves /static/ to a web server: nothing to draw with here
        urllib.request.urlopen(f"http://127.0.0.1:{port}/static/js/omni.js", timeout=10).read()
    except OSError:
        return None
    name, _, value = cookie.partition("=")
    times = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium, args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
        )
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        context.add_cookies([{"name": name, "value": value, "url": f"http://127.0.0.1:{port}"}])
        page = context.new_page()
        for _ in range(rounds + 1):
            page.goto(f"http://127.0.0.1:{port}/jobs/{job_id}/?range=7d", wait_until="commit")
            page.wait_for_function(
                "document.getElementById('chart-gpu') && document.getElementById('chart-gpu')._fullLayout"
                " && document.querySelector('#chart-gpu .heatmaplayer image, #chart-gpu .heatmaplayer .hm')",
                timeout=30_000,
            )
            times.append(page.evaluate("performance.now()"))
        browser.close()
    return times[1:]  # the first load also fetches and compiles Plotly.js


def _wait_for_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"the ASGI server did not listen on 127.0.0.1:{port} within {timeout_s:.0f} s")


# -- main ------------------------------------------------------------------------------------------


def _prepare_environment(args) -> tuple[dict[str, str], Any]:
    """Point this process (and the server it starts) at a fresh database; return env, cleanup."""
    env = dict(os.environ)
    env.pop("REDIS_URL", None)  # one ASGI process: the in-memory channel layer is the honest baseline
    env.setdefault("SECRET_KEY", "omni-bench-live-not-secret")
    database_url = args.database_url or os.environ.get("DATABASE_URL")
    tmp = tempfile.mkdtemp(prefix="omni-bench-live-")
    cleanup = [lambda: shutil.rmtree(tmp, ignore_errors=True)]
    if database_url:
        import psycopg

        base, _, _ = database_url.rpartition("/")
        name = f"omni_bench_live_{os.getpid()}"
        with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')

        def drop() -> None:
            from django.db import connections

            connections.close_all()
            with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

        cleanup.insert(0, drop)
        env["DATABASE_URL"] = f"{base}/{name}"
    else:
        env.pop("DATABASE_URL", None)
        env["OMNI_VAR_DIR"] = tmp
    os.environ.clear()
    os.environ.update(env)
    return env, cleanup


def run(args) -> dict[str, Any]:
    """Seed, measure the page, start the server, measure drawing and fan-out; always clean up."""
    env, cleanup = _prepare_environment(args)
    server = None
    try:
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "omniweb.settings")
        sys.path.insert(0, str(ROOT))
        import django

        django.setup()
        from django.conf import settings
        from django.core.management import call_command
        from django.test import Client

        call_command("migrate", verbosity=0)
        now = datetime.now(UTC)
        user, nodes, job = seed_cluster(args.gpus)
        started = time.perf_counter()
        rows = seed_history(job, nodes, args.days, now)
        seed_s = time.perf_counter() - started
        page_7d = measure_page(user, job, args.rounds, "7d")
        page_6h = measure_page(user, job, args.rounds, "6h")

        node = nodes[0]
        token = node.issue_token()
        node.save(update_fields=["agent_token_hash"])
        client = Client()
        client.force_login(user)
        cookie = f"sessionid={client.cookies['sessionid'].value}"
        port = _free_port()
        server = subprocess.Popen(
            [sys.executable, "manage.py", "serve", "--host", "127.0.0.1", "--port", str(port), "--no-loop"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        _wait_for_port(port, 60)
        draw = measure_browser_draw(port, cookie, job.pk) if args.browser else None
        spacing_s = max(settings.OMNI_TELEMETRY_LIVE_INTERVAL_S, 0.25) + 0.1
        fan = asyncio.run(_fanout(port, cookie, job.pk, node.name, token, args.clients, args.samples, spacing_s))
        return {
            "database": settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1],
            "gpus": args.gpus,
            "history_days": args.days,
            "history_rows": rows,
            "seed_s": round(seed_s, 1),
            "page_range": "7d",
            "page_ms_p50": round(_percentile(page_7d, 50), 1),
            "page_ms_p95": round(_percentile(page_7d, 95), 1),
            "page_6h_ms_p95": round(_percentile(page_6h, 95), 1),
            "page_rounds": args.rounds,
            "browser_draw_ms_p50": round(_percentile(draw, 50), 1) if draw else None,
            "clients": args.clients,
            "samples": args.samples,
            "fanout_ms_p50": round(_percentile(fan["all_ms"], 50), 1),
            "fanout_ms_p95": round(_percentile(fan["all_ms"], 95), 1),
            "fanout_first_client_ms_p50": round(_percentile(fan["first_ms"], 50), 1),
            "fanout_first_to_last_ms_p50": round(_percentile(fan["spread_ms"], 50), 1),
            "fanout_first_to_last_ms_p95": round(_percentile(fan["spread_ms"], 95), 1),
            "ingest_accept_ms_p50": round(_percentile(fan["accept_ms"], 50), 1),
            "fanout_missing_deliveries": fan["missing"],
            "fanout_mean_ms": round(statistics.fmean(fan["all_ms"]), 1) if fan["all_ms"] else None,
        }
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
        for step in cleanup:
            try:
                step()
            except Exception as exc:  # cleanup must not hide the result
                sys.stderr.write(f"bench.live: cleanup failed: {exc}\n")


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m bench.live --json``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--database-url", help="PostgreSQL server to create a throw-away database on")
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--days", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=20, help="page loads measured")
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--samples", type=int, default=30, help="samples fanned out")
    parser.add_argument("--browser", action=argparse.BooleanOptionalAction, default=True,
                        help="also time Chromium drawing the 7-day page (when /usr/bin/chromium exists)")
    args = parser.parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>28}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
