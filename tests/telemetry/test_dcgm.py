"""The dcgm-exporter importer, scraping a real HTTP server on 127.0.0.1 that serves a fixture."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command

from jobs.models import Node
from telemetry.dcgm import parse_exposition
from telemetry.models import GpuSample

FIXTURE = (Path(__file__).parent / "fixtures" / "dcgm-exporter.txt").read_bytes()


class _Exporter(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(FIXTURE)))
        self.end_headers()
        self.wfile.write(FIXTURE)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def exporter_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Exporter)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()


def test_parser_reads_labels_values_and_skips_comments():
    samples = list(parse_exposition('# HELP x y\nx{a="1",b="q\\"uote"} 2.5 1700000000000\ny 3\nbad line here\n'))
    assert [(s.name, s.labels, s.value, s.timestamp_ms) for s in samples] == [
        ("x", {"a": "1", "b": 'q"uote'}, 2.5, 1700000000000), ("y", {}, 3.0, None),
    ]


@pytest.mark.django_db
def test_import_dcgm_stores_each_gpu_of_each_mapped_host(exporter_url):
    Node.objects.create(name="r0s0n0", rack="r0", switch="r0s0", gpu_count=8)
    Node.objects.create(name="gpu-host-b", rack="r0", switch="r0s0", gpu_count=8)
    out, err = StringIO(), StringIO()
    call_command("import_dcgm", exporter_url, "--node-map", "gpu-host-a=r0s0n0", stdout=out, stderr=err)
    assert "stored 4 samples for 2 nodes" in out.getvalue()
    assert "stranger" in err.getvalue()
    a1 = GpuSample.objects.get(node__name="r0s0n0", gpu_index=1)
    assert (a1.util_pct, a1.mem_used_bytes, a1.temp_c, a1.xid_errors) == (88.0, 61235 * 1024 * 1024, 62.0, 0)
    assert a1.power_w == pytest.approx(613.345)
    b1 = GpuSample.objects.get(node__name="gpu-host-b", gpu_index=1)
    assert (b1.util_pct, b1.xid_errors) == (8.0, 1)


@pytest.mark.django_db
def test_unreachable_exporter_is_reported_not_raised():
    err = StringIO()
    call_command("import_dcgm", "http://127.0.0.1:9/metrics", "--timeout-s", "1", stdout=StringIO(), stderr=err)
    assert "scrape failed" in err.getvalue()
