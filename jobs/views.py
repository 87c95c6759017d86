"""Server-rendered pages of the jobs app. The live dashboard builds on these (docs/live-ui.md)."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.db.models import Count, Prefetch
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from jobs import roles
from jobs.models import Allocation, Job, JobState, Node, Reservation
from jobs.models.jobs import TERMINAL_JOB_STATES


@login_required
def dashboard(request: HttpRequest) -> HttpResponse:
    """Jobs (mine first), the node list and reservations, for any user with a role."""
    if not roles.has_any_role(request.user):
        return render(request, "jobs/no_role.html", status=403)
    allocations = Allocation.objects.select_related("node").order_by("node__name", "gpu_index")
    jobs = (
        Job.objects.exclude(state__in=TERMINAL_JOB_STATES)
        .select_related("owner")
        .prefetch_related(Prefetch("allocations", allocations))
        .order_by("priority", "-submitted_at")[:200]
    )
    nodes = Node.objects.annotate(gpus_used=Count("allocations")).order_by("rack", "switch", "name")
    state_counts = dict(Job.objects.values_list("state").annotate(n=Count("id")).order_by())
    context = {
        "jobs": jobs,
        "nodes": nodes,
        "reservations": Reservation.objects.select_related("job").filter(cancelled_at__isnull=True)[:50],
        "state_counts": [(label, state_counts.get(value, 0)) for value, label in JobState.choices],
        "gpus_total": sum(n.gpu_count for n in nodes),
        "gpus_used": Allocation.objects.count(),
        "roles": sorted(roles.role_names(request.user)),
    }
    return render(request, "jobs/dashboard.html", context)
