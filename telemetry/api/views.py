"""Ingestion endpoints: ``POST /api/telemetry/gpu`` and ``POST /api/telemetry/steps``.

Thin shells over telemetry.ingest: a bad batch answers 400 with a message per bad sample and
field (nothing stored), a re-sent batch 200 with ``"duplicate": true``.
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import serializers, status
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs.api.schema import ErrorsAutoSchema
from omniweb.parsers import StrictJSONParser
from telemetry.api.auth import IsNodeAgent, NodeTokenAuthentication
from telemetry.api.serializers import (
    BATCH_ERRORS_SCHEMA,
    GpuBatchSerializer,
    IngestResultSerializer,
    StepBatchSerializer,
)
from telemetry.ingest import IngestResult, ingest_gpu_batch, ingest_step_batch

MAX_BODY_BYTES = 16 * 1024 * 1024


class _BatchView(APIView):
    schema = ErrorsAutoSchema(conflicts=False)
    authentication_classes = [NodeTokenAuthentication]
    permission_classes = [IsNodeAgent]
    parser_classes = [StrictJSONParser]
    throttle_classes: list = []

    def ingest(self, node, batch) -> IngestResult:
        raise NotImplementedError

    def post(self, request: Request) -> Response:
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = 0
        if length > MAX_BODY_BYTES:
            raise ValidationError({"batch": [f"oversized batch: {length} bytes, at most {MAX_BODY_BYTES}"]})
        result = self.ingest(request.auth, request.data)
        return Response(result.as_dict(), status=status.HTTP_200_OK)


def _batch_schema(batch: type[serializers.Serializer]):
    return extend_schema_view(post=extend_schema(
        request=batch, responses={200: IngestResultSerializer, 400: BATCH_ERRORS_SCHEMA}))


@_batch_schema(GpuBatchSerializer)
class GpuBatchView(_BatchView):
    """A node agent's batch of GPU samples."""

    def ingest(self, node, batch) -> IngestResult:
        return ingest_gpu_batch(node, batch)


@_batch_schema(StepBatchSerializer)
class StepBatchView(_BatchView):
    """A node agent's batch of step records, for jobs placed on its node only (400 otherwise)."""

    def ingest(self, node, batch) -> IngestResult:
        return ingest_step_batch(node, batch, placed_only=True)
