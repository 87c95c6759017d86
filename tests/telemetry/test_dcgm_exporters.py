"""``import_dcgm`` against captures in the shapes real dcgm-exporter releases emit: the host as
``hostname`` (4.x) or ``Hostname`` (2.x, 3.x), ``pci_bus_id`` and Kubernetes pod labels, and
DCGM's blank sentinels (no reading), scraped over real HTTP on 127.0.0.1."""

from __future__ import annotations

import threading
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command

from jobs.models import Node
from telemetry.dcgm import import_text, is_dcgm_blank
from telemetry.models import GpuSample

FIXTURES = Path(__file__).parent / "fixtures"

pytestmark = pytest.mark.django_db


class _Exporter(BaseHTTPRequestHandler):
    def __init__(self, body: bytes, *args, **kwargs) -> None:
        self.body = body
        super().__init__(*args, **kwargs)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args) -> None:
        pass


def _serve(name: str):
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Exporter, (FIXTURES / name).read_bytes()))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/metrics"


def _scrape(name: str, *args: str) -> tuple[str, str]:
    server, url = _serve(name)
    out, err = StringIO(), StringIO()
    try:
        call_command("import_dcgm", url, *args, stdout=out, stderr=err)
    finally:
        server.shutdown()
        server.server_close()
    return out.getvalue(), err.getvalue()


@pytest.mark.parametrize(("value", "blank"), [
    (9223372036854775794, True), (9223372036854775792, True), (2147483632, True), (2147483635, True),
    (140737488355328.0, True), (140737488355331.0, True), (2147483631, False), (0, False), (700.5, False),
])
def test_dcgm_blank_sentinels_are_recognised(value, blank):
    assert is_dcgm_blank(float(value)) is blank


def test_a_4x_capture_with_lower_case_hostname_maps_through_node_map():
    Node.objects.create(name="r0s0n0", rack="r0", switch="r0s0", gpu_count=8)
    out, err = _scrape("dcgm-exporter-4.x-hostname.txt", "--node-map", "gpu-node-7=r0s0n0")
    assert "no node" not in err and "rejected" not in err
    # GPU 1's memory is DCGM's "not supported" sentinel: no reading, so no sample; GPU 0's power
    # is the fp64 blank: stored without power.
    assert "stored 1 samples for 1 nodes" in out
    sample = GpuSample.objects.get(node__name="r0s0n0")
    assert (sample.gpu_index, sample.util_pct, sample.mem_used_bytes, sample.temp_c) == (0, 91.0, 70000 * 2**20, 64.0)
    assert sample.power_w is None


def test_a_2x_capture_with_hostname_label_is_imported():
    Node.objects.create(name="v100-a", rack="r0", switch="r0s0", gpu_count=8)
    out, err = _scrape("dcgm-exporter-2.x.txt", "--node-map", "dcgm-exporter-2x7kq=v100-a")
    assert "stored 1 samples for 1 nodes" in out, err
    assert GpuSample.objects.get(node__name="v100-a").util_pct == 45.0


def test_an_unmapped_lower_case_host_is_named_not_reported_missing():
    result = import_text((FIXTURES / "dcgm-exporter-4.x-hostname.txt").read_text(), source="t", seq=0)
    assert result.unknown_hosts == {"gpu-node-7"}
