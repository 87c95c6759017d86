"""``GET /api/jobs/{id}/logs/``: a job's log lines, oldest first, paged by line id (docs/logs.md).

Who may read them is the job page's rule: only viewers who see the job in full
(``roles.job_visibility``); a job they may only summarise is a 403, one they may not know of a
404, as on ``/jobs/<id>/``. The action itself is ``JobViewSet.logs`` (jobs/api/views.py).
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import OpenApiParameter
from rest_framework import serializers
from rest_framework.exceptions import NotFound, PermissionDenied, ValidationError
from rest_framework.request import Request

from jobs import roles
from jobs.models import Job, JobLogLine, LogStream

DEFAULT_LIMIT = 500
MAX_LIMIT = 5000
PARAMS = ("rank", "stream", "after", "limit", "format")

LOG_PARAMETERS = [
    OpenApiParameter("rank", int, many=True, description="Only these global ranks (repeat it, or a comma list)."),
    OpenApiParameter("stream", str, enum=[c for c, _ in LogStream.choices], description="stdout (out) or stderr (err)."),
    OpenApiParameter("after", int, description="Lines after this line id: the previous page's next_after."),
    OpenApiParameter("limit", int, description=f"At most this many lines (default {DEFAULT_LIMIT}, at most {MAX_LIMIT})."),
]


class JobLogLineSerializer(serializers.ModelSerializer):
    class Meta:
        model = JobLogLine
        fields = ["id", "run_id", "node", "rank", "stream", "at", "text"]
        read_only_fields = fields


class JobLogPageSerializer(serializers.Serializer):
    """One page of lines; ``next_after`` is the ``after`` of the next page, null when this page
    reached the newest line (a client following the log polls with its last line's id)."""

    lines = JobLogLineSerializer(many=True)
    next_after = serializers.IntegerField(allow_null=True)


def _integer(name: str, raw: str, minimum: int, maximum: int | None = None) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ValidationError({name: f"{raw!r} is not an integer"}) from None
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"from {minimum} to {maximum}" if maximum is not None else f"at least {minimum}"
        raise ValidationError({name: f"must be {bound}, got {value}"})
    return value


def log_filters(request: Request) -> dict[str, Any]:
    """The query's ranks, stream, cursor and limit; a 400 naming the parameter that is wrong."""
    params = request.query_params
    unknown = sorted(set(params) - set(PARAMS))
    if unknown:
        raise ValidationError({name: f"unknown parameter; expected one of {', '.join(PARAMS[:-1])}" for name in unknown})
    ranks = [_integer("rank", part.strip(), 0) for value in params.getlist("rank") for part in value.split(",")
             if part.strip()]
    stream = params.get("stream") or None
    if stream is not None and stream not in LogStream.values:
        raise ValidationError({"stream": f"{stream!r} is not one of {', '.join(LogStream.values)}"})
    after = _integer("after", params["after"], 0) if params.get("after") else 0
    limit = _integer("limit", params["limit"], 1, MAX_LIMIT) if params.get("limit") else DEFAULT_LIMIT
    return {"ranks": ranks, "stream": stream, "after": after, "limit": limit}


def job_log_page(request: Request, pk: Any) -> dict[str, Any]:
    """The page of lines the request asks for, of a job the user sees in full."""
    filters = log_filters(request)
    job = roles.visible_jobs(request.user, Job.objects.only("id", "name", "owner_id")).filter(pk=pk).first() \
        if str(pk).isdigit() else None
    if job is None:
        raise NotFound(f"no job {pk}")
    if roles.job_visibility(request.user, job) is not roles.Visibility.FULL:
        raise PermissionDenied(f"{job.name}'s logs are visible to its owner, operators and auditors")
    lines = JobLogLine.objects.filter(job=job, id__gt=filters["after"])
    if filters["ranks"]:
        lines = lines.filter(rank__in=filters["ranks"])
    if filters["stream"]:
        lines = lines.filter(stream=filters["stream"])
    page = list(lines.order_by("id")[: filters["limit"] + 1])
    more = len(page) > filters["limit"]
    page = page[: filters["limit"]]
    return JobLogPageSerializer({"lines": page, "next_after": page[-1].id if more else None}).data
