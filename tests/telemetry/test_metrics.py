"""/metrics: Prometheus text format, protected for operators or a bearer token."""

from __future__ import annotations

import re

import pytest
from django.test import Client, override_settings
from django.utils import timezone

from jobs.models import PlannerRun
from telemetry import metrics
from telemetry.ingest import ingest_gpu_batch
from tests.telemetry.conftest import gpu_batch

pytestmark = pytest.mark.django_db
SAMPLE_LINE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="[^"]*",?)*\})? (NaN|-?[0-9.e+-]+)$')


def _families(text: str) -> dict[str, str]:
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M))


def test_operator_reads_every_family_in_text_format(operator, node, make_job, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        ingest_gpu_batch(node, gpu_batch(samples=16))
    make_job()
    PlannerRun.objects.create(started_at=timezone.now(), duration_ms=42.0)
    metrics.websocket_opened("live")
    client = Client()
    client.force_login(operator)
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain; version=0.0.4")
    text = response.content.decode()
    families = _families(text)
    for name in (
        "omni_telemetry_samples_stored_total", "omni_telemetry_ingest_rate_samples_per_second",
        "omni_telemetry_ingest_lag_seconds", "omni_planner_pass_duration_seconds", "omni_queue_length",
        "omni_commands", "omni_commands_expired_total", "omni_websocket_clients",
    ):
        assert name in families, name
    for line in text.splitlines():
        assert line.startswith("#") or SAMPLE_LINE.match(line), line
    assert 'omni_telemetry_samples_stored_total{kind="gpu"} 16' in text
    assert 'omni_queue_length{priority="regular"} 1' in text
    assert "omni_planner_last_pass_duration_seconds 0.042" in text
    assert 'omni_websocket_clients{kind="live"} 1' in text
    assert 'omni_telemetry_batches_total{kind="gpu",outcome="stored"} 1' in text


def test_anonymous_is_401_and_researcher_403(researcher):
    assert Client().get("/metrics").status_code == 401
    client = Client()
    client.force_login(researcher)
    assert client.get("/metrics").status_code == 403


@override_settings(OMNI_METRICS_TOKEN="scrape-me-0123456789")
def test_bearer_token_reads_metrics_and_a_wrong_one_is_403():
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-me-0123456789").status_code == 200
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer nope").status_code == 403


def test_no_token_configured_means_bearer_is_refused():
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer anything").status_code == 403
