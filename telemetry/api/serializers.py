"""The shapes of the ingestion endpoints' bodies, for the OpenAPI schema (docs/telemetry.md).

They describe; they do not validate: ``telemetry.ingest`` checks a batch column-wise (a few µs a
sample, where a serializer would take a hundred times that), and its rules are the ones written
here. ``tests/jobs/test_api_hardening.py`` holds the two to the same fields.
"""

from __future__ import annotations

from django.conf import settings
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from telemetry.ingest.validate import SOURCE_MAX_LENGTH, TOKEN_MODALITIES

SECONDS_MAX = 86_400.0


@extend_schema_field({
    "oneOf": [{"type": "number"}, {"type": "string", "format": "date-time"}],
    "description": "Unix seconds, or an ISO 8601 time with a timezone; at most a few minutes ahead.",
})
class SampleTimeField(serializers.Field):
    """``at``: Unix seconds or an ISO 8601 string."""


def _seconds(**kwargs) -> serializers.FloatField:
    return serializers.FloatField(min_value=0.0, max_value=SECONDS_MAX, **kwargs)


class GpuSampleSerializer(serializers.Serializer):
    """One reading of one GPU of the sending node."""

    gpu = serializers.IntegerField(min_value=0, max_value=32767, help_text="0 <= gpu < the node's GPU count.")
    at = SampleTimeField()
    util_pct = serializers.FloatField(min_value=0.0, max_value=100.0)
    mem_used_bytes = serializers.IntegerField(min_value=0, max_value=2**53)
    power_w = serializers.FloatField(min_value=0.0, max_value=100_000.0, required=False, allow_null=True)
    temp_c = serializers.FloatField(min_value=-100.0, max_value=300.0, required=False, allow_null=True)
    xid_errors = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False,
                                          help_text="XID errors since the last sample; absent: 0.")


class TokenCountsSerializer(serializers.Serializer):
    """Tokens of each modality in the step."""

    def get_fields(self) -> dict[str, serializers.Field]:
        return {m: serializers.IntegerField(min_value=0, max_value=2**62 - 1, required=False)
                for m in TOKEN_MODALITIES}


class StepRecordSerializer(serializers.Serializer):
    """One step of one rank of a job placed on the sending node."""

    job = serializers.IntegerField(min_value=1, max_value=2**53, help_text="A job placed on the sending node.")
    rank = serializers.IntegerField(min_value=0, max_value=2**31 - 1)
    step = serializers.IntegerField(min_value=0, max_value=2**53)
    at = SampleTimeField(help_text="When the step ended.")
    step_s = _seconds()
    data_wait_s = _seconds(required=False, allow_null=True)
    compute_s = _seconds(required=False, allow_null=True)
    comm_s = _seconds(required=False, allow_null=True)
    tokens = TokenCountsSerializer(required=False, allow_null=True)
    loss = serializers.FloatField(min_value=-1e30, max_value=1e30, required=False, allow_null=True)


class _BatchSerializer(serializers.Serializer):
    source = serializers.CharField(min_length=1, max_length=SOURCE_MAX_LENGTH,
                                   help_text="One sender stream, unique per node (printable).")
    seq = serializers.IntegerField(min_value=0, max_value=2**63 - 1,
                                   help_text="Rising per source; a (source, seq) stored before is a duplicate.")


class GpuBatchSerializer(_BatchSerializer):
    """``POST /api/telemetry/gpu``: a node's GPU samples."""

    samples = GpuSampleSerializer(many=True, min_length=1, max_length=settings.OMNI_TELEMETRY_MAX_BATCH)


class StepBatchSerializer(_BatchSerializer):
    """``POST /api/telemetry/steps``: step records of jobs placed on the node."""

    samples = StepRecordSerializer(many=True, min_length=1, max_length=settings.OMNI_TELEMETRY_MAX_BATCH)


class IngestResultSerializer(serializers.Serializer):
    """What happened to a batch (``telemetry.ingest.IngestResult.as_dict``)."""

    kind = serializers.ChoiceField(choices=["gpu", "steps"])
    source = serializers.CharField()
    seq = serializers.IntegerField()
    accepted = serializers.IntegerField(help_text="Samples stored; 0 for a duplicate.")
    duplicate = serializers.BooleanField()


# A refused batch (400): messages by ``samples[i].field`` (or ``source``, ``seq``, ``samples``, ``batch``);
# a body that is not strict JSON never reaches a field: its 400 is the parser's ``detail`` sentence.
BATCH_ERRORS_SCHEMA = {
    "type": "object",
    "properties": {"detail": {"type": "string"}},
    "additionalProperties": {"type": "array", "items": {"type": "string"}},
}
