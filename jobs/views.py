"""Server-rendered pages: the researcher's dashboard and job page, the operator's console and
the auditor's review, with their POST-only actions and streamed exports (docs/live-ui.md).

Every write calls a function in ``jobs.actions`` (which checks the role again and audits it);
``PermissionDenied`` becomes a 403 page. Pages render complete state; ``static/js/live.js``
then keeps them current over ``/ws/live/``.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime, timedelta
from functools import wraps
from pathlib import Path
from typing import Any

import plotly
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.cache import cache
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import Count, Prefetch, Q
from django.http import (
    FileResponse,
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
    JsonResponse,
    StreamingHttpResponse,
)
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from jobs import actions, roles
from jobs.actions.jobs import SubmissionCheck, check_submission, entrypoint_words
from jobs.audit import GENESIS_HASH, link_problem
from jobs.forms import (
    AuditFilterForm,
    JobFilterForm,
    PlannerControlForm,
    ReservationForm,
    SubmitJobForm,
    TeamForm,
    TeamMemberForm,
)
from jobs.live_consumers import payload_for_user
from jobs.live_data import (
    CLASS_ORDER,
    RANGES,
    cluster_summary,
    eta,
    held_gpus,
    human_duration,
    job_checkpoints,
    job_counts,
    job_markers,
    job_series,
    last_events,
    last_holds,
    loans_by_reservation,
    measured_step_s,
    reservation_boundaries,
    reservation_windows,
    rhythm_summary,
    utilisation_series,
)
from jobs.live_events import compact_nodes, describe_event, disk_note, event_payload
from jobs.models import (
    REFERENCE_ENTRYPOINT,
    Allocation,
    ElasticEvent,
    EventKind,
    IllegalTransition,
    Integration,
    Job,
    JobLogLine,
    Node,
    NodeState,
    PlannerControl,
    Reservation,
    Team,
    TeamInUse,
)
from jobs.planner.layout import fit_problems
from jobs.planner.wording import plural
from jobs.team_data import team_detail, team_standings, team_usage_series
from jobs.waiting import waiting_note

AUDIT_PAGE_SIZE = 100
# The rows that end a job's last run, naming the nodes they released.
ENDING_KINDS = frozenset({EventKind.COMPLETE, EventKind.FAIL, EventKind.CANCEL})
EXPORT_CHUNK_ROWS = 2000
CHAIN_VERIFY_BUDGET_ROWS = 200_000
CHAIN_CACHE_KEY = "omni:audit-chain-verified"


def role_required(check: Callable[[Any], bool], what: str):
    """Signed-in users only (anonymous -> login); users failing ``check`` get a 403 page."""

    def decorate(view):
        @wraps(view)
        @login_required
        def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponseBase:
            if not roles.has_any_role(request.user):
                return render(request, "jobs/no_role.html", status=403)
            if not check(request.user):
                raise PermissionDenied(what)
            return view(request, *args, **kwargs)

        return wrapper

    return decorate


any_role = role_required(roles.has_any_role, "you need an Omni role")
audit_reader = role_required(roles.can_read_audit, "only operators and auditors may review the audit log")


def _page_context(request: HttpRequest, section: str) -> dict[str, Any]:
    user = request.user
    return {
        "section": section,
        "roles": sorted(roles.role_names(user)),
        "is_operator": roles.is_operator(user),
        "can_read_audit": roles.can_read_audit(user),
        "plotly_version": plotly.__version__,
    }


# -- researchers: the dashboard ---------------------------------------------------------------


submitter = role_required(roles.can_submit, "only researchers and operators submit jobs")


@require_GET
@any_role
def dashboard(request: HttpRequest) -> HttpResponse:
    """The jobs list, with the submit form for those who may submit."""
    form = SubmitJobForm(user=request.user) if roles.can_submit(request.user) else None
    return render(request, "jobs/dashboard.html", _dashboard_context(request, form))


def _dashboard_context(request: HttpRequest, submit_form: SubmitJobForm | None) -> dict[str, Any]:
    """My jobs (everyone's for operators and auditors) with progress, ETA and the last word.

    Every row is a job ``roles.visible_jobs`` lets the viewer see; a row they may only
    summarise (someone else's job, ``OMNI_JOB_VISIBILITY=summary``) shows its name, owner,
    class, state and GPUs, without a link and without the rest.
    """
    user = request.user
    default_mine = roles.is_researcher(user) and not (roles.is_operator(user) or roles.is_auditor(user))
    form = JobFilterForm(request.GET)
    form.is_valid()
    jobs_qs = form.filter(
        roles.visible_jobs(user, Job.objects.select_related("owner").annotate(
            gpus=Count("allocations"),
            borrowed=Count("allocations", filter=Q(allocations__borrowed_from__isnull=False)),
        )),
        user,
        default_mine,
    ).order_by(CLASS_ORDER, "-submitted_at")
    jobs = list(jobs_qs[:200])
    full = {job.pk for job in jobs if roles.job_visibility(user, job) is roles.Visibility.FULL}
    rhythm = measured_step_s(full)
    newest = last_events(full)
    holds = last_holds([job.pk for job in jobs if job.pk in full and job.is_waiting])
    rows = []
    for job in jobs:
        if job.pk not in full:
            rows.append({"job": job, "full": False})
            continue
        seconds_left, measured = eta(job, rhythm.get(job.pk))
        last = newest.get(job.pk)
        rows.append({
            "job": job,
            "full": True,
            "eta": human_duration(seconds_left),
            "eta_measured": measured,
            "step_s": rhythm.get(job.pk, job.step_s),
            "last_text": describe_event(last, with_time=False) if last else "",
            "last_at": last.at if last else None,
            "waiting": waiting_note(job, holds.get(job.pk)),
        })
    context = {
        **_page_context(request, "dashboard"),
        "form": form,
        "rows": rows,
        "truncated": len(jobs) == 200,
        "default_mine": default_mine,
        "show_owner": any(job.owner_id != user.pk for job in jobs) or not default_mine,
        # With OMNI_JOB_VISIBILITY=own a researcher sees no one else's jobs: no "Everyone's".
        "sees_others": roles.owner_visibility(user, None) > roles.Visibility.NONE,
        "counts": job_counts(),
        "gpus_total": sum(Node.objects.values_list("gpu_count", flat=True)),
        "held": held_gpus(),
        "submit_form": submit_form,
    }
    return context


@require_POST
@submitter
def job_submit(request: HttpRequest) -> HttpResponse:
    """The dashboard's submit form: ``submit_job`` with the API's rules, its refusals shown on the
    fields they name (the dashboard again, 400); a submitted job's page next."""
    form = SubmitJobForm(request.POST, user=request.user)
    if form.is_valid():
        try:
            job = actions.submit_job(request.user, **form.spec())
        except ValidationError as exc:
            form.add_action_errors(exc)
        else:
            messages.success(request, f"Submitted {job.name}: {plural(job.gpus_wanted, 'GPU')} wanted; the planner places it.")
            return redirect("job-page", pk=job.pk)
    return render(request, "jobs/dashboard.html", _dashboard_context(request, form), status=400)


@require_POST
@submitter
def job_submit_preview(request: HttpRequest) -> JsonResponse:
    """The submit form's live check: the form's own field problems, then every rule
    ``submit_job`` applies (``check_submission``, nothing saved), by field, and the job in words.
    Fields not filled in yet are checked at their defaults and their problems left to the form."""
    form = SubmitJobForm(request.POST, user=request.user)
    checked = check_submission(request.user, **form.preview_spec())
    form.add_action_errors(ValidationError(checked.errors), skip=form.preview_defaulted)
    wrong = set(form.errors)
    return JsonResponse({
        "errors": {name: list(problems) for name, problems in form.errors.items()},
        # No words for a shape that cannot run (or is not typed in yet): its message says why.
        "preview": "" if wrong & set(SubmitJobForm.LAYOUT_FIELDS) else submission_preview(checked, wrong),
    })


def submission_preview(checked: SubmissionCheck, wrong: set[str] = frozenset()) -> str:
    """The job in words, as the planner would size and fit it: "Needs 8 GPUs: 2 replicas of TP 4;
    accumulation 4; fits on 1 of 3 switches." The fit is ``fit_problems``, the rule submission
    refuses by, asked of each leaf switch at the preferred DP. ``wrong``: fields with a problem,
    whose facts are left out."""
    job = checked.job
    shape = " × ".join(f"{name} {n}" for name, n in (("TP", job.tp), ("PP", job.pp)) if n > 1) or "1 GPU"
    parts = [f"Needs {plural(job.gpus_wanted, 'GPU')}: {plural(job.dp, 'replica')} of {shape}"]
    if job.dp_min != job.dp_max:
        parts[0] += f" (elastic: {job.dp_min} to {job.dp_max} replicas)"
    if not wrong & {"global_batch", "micro_batch"}:
        parts.append(f"accumulation {job.accum_steps} (global batch {job.global_batch} = micro-batch "
                     f"{job.micro_batch} × {job.dp} × {job.accum_steps})")
    switches = checked.switch_gpus
    switch_words = f"{len(switches)} switch" if len(switches) == 1 else f"{len(switches)} switches"
    if not switches:
        parts.append("no nodes registered yet")
    else:
        fits = sum(1 for gpus in switches.values() if not fit_problems(job.tp, job.pp, job.dp, gpus))
        if fits:
            parts.append(f"fits on {fits} of {switch_words}")
        elif not fit_problems(job.tp, job.pp, job.dp, checked.node_gpus):
            parts.append(f"no single switch holds it: its replicas span several of the {switch_words}")
        else:
            room = sum(n // job.tp for n in checked.node_gpus) // job.pp
            parts.append(f"the whole cluster has room for {plural(room, 'replica')} of it, so it runs below DP {job.dp}")
    if not wrong & {"total_steps", "step_s"}:
        parts.append(f"{job.total_steps} steps × {job.step_s:g} s ≈ {human_duration(job.total_steps * job.step_s)}")
    return "; ".join(parts) + "."


# -- researchers: the job page ------------------------------------------------------------------


def _job_for(request: HttpRequest, pk: int) -> Job:
    """The job if the viewer may open its page: 404 when they may not know of it, 403 when they
    may only see its summary (no page links there: ``{% job_link %}`` renders plain text)."""
    job = get_object_or_404(roles.visible_jobs(request.user, Job.objects.select_related("owner", "team")), pk=pk)
    if roles.job_visibility(request.user, job) is not roles.Visibility.FULL:
        raise PermissionDenied(f"{job.name} belongs to {job.owner.username}: its details are visible to its owner, "
                               "operators and auditors; its summary is on the jobs list")
    return job


def _ended(job: Job) -> dict[str, Any] | None:
    """For a finished job's page, in place of an ETA: how long it took from submission, and how
    long of that it ran (from its first start); None while it has not ended."""
    if not job.is_terminal or job.finished_at is None:
        return None
    began = job.first_started_at
    return {"state": job.get_state_display().lower(), "at": job.finished_at,
            "took": human_duration((job.finished_at - job.submitted_at).total_seconds()),
            "ran": human_duration((job.finished_at - began).total_seconds()) if began else None}


def _last_nodes(job: Job, newest_first: list[ElasticEvent]) -> str | None:
    """Where a finished job last ran: the nodes its ending row released (the page's "ran on")."""
    ended = next((e for e in newest_first if e.kind in ENDING_KINDS and e.nodes_before), None)
    return compact_nodes(ended.nodes_before) if ended else None


def _series_range(job: Job, since: datetime, now: datetime) -> tuple[datetime, datetime]:
    """The part of the page's range the job lived in (a minute either side): the buckets are cut
    from it, so a half-minute job on the 6 h view reads 1 s buckets, not two 37 s ones."""
    start = max(since, job.submitted_at - timedelta(minutes=1))
    end = min(now, job.finished_at + timedelta(minutes=1)) if job.finished_at else now
    return (start, end) if end > start else (since, now)


@require_GET
@any_role
def job_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """One job: live timelines with scheduler markers, tokens, checkpoints, log, why pending.

    ``?panels=1`` renders the same page without the charts' series or the log's lines: the page
    left open fetches it after each of the job's audit rows and swaps in its ``data-panel`` parts
    (the facts, the failure, the steps, ETA or end, the last checkpoint, why it waits, the GPUs
    it holds...), so they stay the server's words (docs/live-ui.md)."""
    job = _job_for(request, pk)
    panels_only = request.GET.get("panels") == "1"
    range_key = request.GET.get("range", "6h")
    if range_key not in RANGES:
        range_key = "6h"
    now = timezone.now()
    since = now - RANGES[range_key]
    allocations = list(
        Allocation.objects.filter(job=job).select_related("node", "borrowed_from").order_by("node__name", "gpu_index")
    )
    events = list(
        job.events.select_related("refers_to").prefetch_related("outcomes").order_by("-id")[:200]
    )
    checkpoints = job_checkpoints(job)
    hold = next((e for e in events if e.kind == EventKind.HOLD), None)
    rhythm = measured_step_s([job.pk]).get(job.pk)
    seconds_left, measured = eta(job, rhythm)
    by_node: dict[str, list[Allocation]] = {}
    loans: dict[int, dict[str, Any]] = {}
    for allocation in allocations:
        by_node.setdefault(allocation.node.name, []).append(allocation)
        if allocation.borrowed_from_id:
            loan = loans.setdefault(allocation.borrowed_from_id, {
                "reservation": allocation.borrowed_from.name, "gpus": 0, "until": allocation.loan_until})
            loan["gpus"] += 1
            if allocation.loan_until and (loan["until"] is None or allocation.loan_until < loan["until"]):
                loan["until"] = allocation.loan_until
    chart = {"job_id": job.pk} if panels_only else {
        "job_id": job.pk,
        "since": since.isoformat(),
        "until": now.isoformat(),
        "series": job_series(job, *_series_range(job, since, now)),
        "markers": job_markers(job, since) + reservation_boundaries(job, since, now + timedelta(hours=1)),
        "gpu_keys": [{"name": f"{a.node.name}/{a.gpu_index}", "node": a.node_id, "gpu": a.gpu_index}
                     for a in allocations],
    }
    context = {
        **_page_context(request, "dashboard"),
        "job": job,
        "can_act": roles.can_act_on_job(request.user, job),
        "allocations": allocations,
        "by_node": by_node,
        "nodes_text": compact_nodes(by_node),
        "ran_on": _last_nodes(job, events) if job.is_terminal and not by_node else None,
        "borrowed": sum(1 for a in allocations if a.borrowed_from_id),
        "loans": list(loans.values()),
        "events": [{"event": e, "text": describe_event(e, with_time=False)} for e in events],
        "checkpoints": checkpoints,
        "last_checkpoint": checkpoints[0] if checkpoints else None,
        "waiting": waiting_note(job, hold),
        "eta": human_duration(seconds_left),
        "eta_measured": measured,
        "step_s": rhythm or job.step_s,
        "ended": _ended(job),
        "range_key": range_key,
        "ranges": list(RANGES),
        "chart": chart,
        **_job_logs_context(job, with_lines=not panels_only),
        "workload": _workload(job),
        "rhythm": rhythm_summary(job),
    }
    return render(request, "jobs/job_detail.html", context)


def _workload(job: Job) -> dict[str, Any]:
    """What runs on the job's GPUs (docs/workloads.md): the command, how it is stopped, the
    environment's names (never its values)."""
    signal_mode = job.integration == Integration.SIGNAL
    return {
        "command": entrypoint_words(job.entrypoint),
        "reference": list(job.entrypoint) == list(REFERENCE_ENTRYPOINT),
        "workdir": job.workdir or "the job's run dir",
        "stop": (f"SIGTERM, {job.grace_s:g} s grace, then SIGKILL; not elastic" if signal_mode
                 else "cooperative checkpoint-and-stop (Omni runtime); elastic by whole replicas"),
        "integration": ("signal: any script, no Omni import" if signal_mode
                        else "omni: the script uses trainer_agent.runtime"),
        "env_names": sorted(job.env),
        "restarts": f"{job.restarts} of {job.max_restarts} used" if job.max_restarts else "none (max_restarts 0)",
        "run_id": job.run_id,
    }


# The Logs panel (docs/logs.md): the newest lines rendered with the page, then followed live.
LOG_PANEL_LINES = 200


def _job_logs_context(job: Job, *, with_lines: bool = True) -> dict[str, Any]:
    """The Logs panel's newest lines (oldest first), the ranks its filter offers, and the
    failure box: one query, whatever the size of the log; none without ``with_lines`` (the panels a
    page left open fetches again: its log follows the socket)."""
    lines = list(JobLogLine.objects.filter(job=job).order_by("-id")
                 .only("id", "rank", "stream", "node", "at", "text")[:LOG_PANEL_LINES])[::-1] if with_lines else []
    # The ranks of the current layout, plus any an earlier, larger layout left in the lines.
    top = max([job.gpus_wanted - 1, *(line.rank for line in lines)])
    return {"log_lines": lines, "log_ranks": list(range(top + 1)), "log_panel_lines": LOG_PANEL_LINES,
            "failure": failure_note(job.failure)}


def failure_note(failure: dict[str, Any] | None) -> dict[str, Any] | None:
    """``Job.failure`` in words: "Rank 1 on node-b exited with code 1", its log's tail, when."""
    if not failure:
        return None
    who = f"Rank {failure['rank']}" if isinstance(failure.get("rank"), int) else "torchrun"
    if failure.get("signal"):
        how = f"exited with signal {failure['signal']}"
    elif failure.get("code") is not None:
        how = f"exited with code {failure['code']}"
    else:
        how = "failed"
    where = f" on {failure['node']}" if failure.get("node") else ""
    at = failure.get("at")
    if isinstance(at, (int, float)) and not isinstance(at, bool):
        at = datetime.fromtimestamp(at, tz=UTC)
    return {"sentence": f"{who}{where} {how}", "tail": str(failure.get("tail") or ""), "at": at,
            "run_id": failure.get("run_id") or ""}


@require_POST
@any_role
def job_cancel(request: HttpRequest, pk: int) -> HttpResponse:
    """Cancel a job (owner or operator); an illegal move is explained, not raised."""
    job = get_object_or_404(roles.visible_jobs(request.user, Job.objects), pk=pk)
    try:
        actions.cancel_job(job, request.user)
        messages.success(request, f"Cancelled {job.name}.")
    except IllegalTransition as exc:
        messages.error(request, str(exc))
    return redirect("job-page", pk=pk)


# -- operators: the console ---------------------------------------------------------------------


def _cluster_map(user, nodes: list[Node]) -> list[dict[str, Any]]:
    """Racks -> switches -> nodes -> GPUs, with each node's runs-dir space; a GPU held by a job
    the viewer may not see shows its class (the cluster's occupancy) but not the job."""
    racks: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for node in nodes:
        held = {a.gpu_index: a for a in node.allocations.all()}
        gpus = []
        for index in range(node.gpu_count):
            allocation = held.get(index)
            known = allocation is not None and roles.job_visibility(user, allocation.job) > roles.Visibility.NONE
            gpus.append({
                "index": index,
                "job": allocation.job.name if known else None,
                "job_id": allocation.job_id if known else None,
                "priority": allocation.job.priority if allocation else None,
                "borrowed": bool(allocation and allocation.borrowed_from_id),
                "held": allocation is not None,
            })
        racks.setdefault(node.rack, {}).setdefault(node.switch, []).append(
            {"node": node, "gpus": gpus, "disk": disk_note(node)})
    return [{"rack": rack, "switches": [{"switch": s, "nodes": n} for s, n in switches.items()]}
            for rack, switches in racks.items()]


@require_GET
@any_role
def console(request: HttpRequest) -> HttpResponse:
    """The cluster map, planner controls, reservations timeline, utilisation and the queue.

    Jobs appear as ``roles.job_visibility`` allows: the queue lists the jobs the viewer may see
    (the reason a job waits only for those seen in full), and GPUs, reservations and loans of
    jobs the viewer may not see name no job. The header, queue and planner line are the live
    ``cluster_summary``, cut for the viewer as the socket cuts it.

    ``?panels=1`` renders the same page without the utilisation history (the walk back through
    the log): what the page left open fetches to redraw its reservations and loans.
    """
    user = request.user
    now = timezone.now()
    panels_only = request.GET.get("panels") == "1"
    allocations = Allocation.objects.select_related("job").order_by("gpu_index")
    nodes = list(Node.objects.prefetch_related(Prefetch("allocations", allocations)).order_by("rack", "switch", "name"))
    control = PlannerControl.load()
    summary = payload_for_user(user, "cluster_summary", cluster_summary(now, control=control))
    reservations = list(
        Reservation.objects.select_related("job", "team").filter(
            Q(end_at__isnull=True) | Q(end_at__gte=now - timedelta(hours=6)), cancelled_at__isnull=True
        )[:100]
    )
    since, until = now - timedelta(hours=6), now + timedelta(hours=18)
    loans = loans_by_reservation()
    gantt = [
        {
            "name": r.name, "gpus": r.gpus,
            "job": f"team {r.team.name}" if r.team_id else roles.job_name_for(user, r.job.name, r.job.owner_id),
            "spares": r.spares,
            "windows": [[s.isoformat(), e.isoformat()] for s, e in reservation_windows(r, since, until)],
            "loans": [_gantt_loan(user, loan, until) for loan in loans.get(r.pk, [])],
        }
        for r in reservations
    ]
    gpus_total = sum(node.gpu_count for node in nodes)
    context = {
        **_page_context(request, "console"),
        "racks": _cluster_map(user, nodes),
        "summary": summary,
        "reservations": reservations,
        "control": control,
        "control_form": PlannerControlForm(instance=control),
        "console_data": {
            "gantt": gantt, "since": since.isoformat(), "until": until.isoformat(), "now": now.isoformat(),
            "utilisation": None if panels_only else utilisation_series(now - timedelta(hours=24), now,
                                                                        gpus_total=gpus_total),
            "gpus_total": gpus_total,
            "node_actions": NODE_ACTIONS_FROM,
        },
    }
    return render(request, "jobs/console.html", context)


def _gantt_loan(user, loan: dict[str, Any], until) -> dict[str, Any]:
    """A loan on the reservations Gantt, naming the borrower only if the viewer may know it."""
    known = roles.owner_visibility(user, loan["owner_id"]) > roles.Visibility.NONE
    return {
        "job": loan["job"] if known else roles.HIDDEN_JOB, "job_id": loan["job_id"] if known else None,
        "priority": loan["priority"], "gpus": loan["gpus"], "since": loan["since"].isoformat(),
        "until": loan["until"].isoformat() if loan["until"] else until.isoformat(),
    }


# Which node actions make sense from which health state (the buttons the console offers).
NODE_ACTIONS_FROM: dict[str, list[str]] = {
    NodeState.HEALTHY: ["cordon", "drain"],
    NodeState.SUSPECT: ["cordon", "drain", "repair"],
    NodeState.FAILED: ["cordon", "repair"],
    NodeState.CORDONED: ["uncordon", "drain"],
    NodeState.DRAINING: ["uncordon", "cordon"],
}

NODE_ACTIONS: dict[str, tuple[Callable[..., Node], str]] = {
    "cordon": (actions.cordon_node, "cordoned"),
    "uncordon": (actions.uncordon_node, "returned to service"),
    "drain": (actions.drain_node, "draining"),
    "repair": (actions.mark_node_repaired, "marked repaired"),
}


@require_POST
@login_required
def node_action(request: HttpRequest, pk: int, action: str) -> HttpResponse:
    """Cordon, uncordon, drain or mark repaired: operators only (403 for anyone else)."""
    if action not in NODE_ACTIONS:
        raise Http404(f"no node action {action!r}")
    node = get_object_or_404(Node, pk=pk)
    do, done = NODE_ACTIONS[action]
    try:
        do(node, request.user)
        messages.success(request, f"{node.name} {done}.")
    except IllegalTransition as exc:
        messages.error(request, str(exc))
    return redirect(f"{_console_url()}#node-{node.name}")


def _console_url() -> str:
    return reverse("console")


@require_POST
@login_required
def planner_control(request: HttpRequest) -> HttpResponse:
    """Pause/resume, dry run and the knobs; only the fields that changed are applied."""
    roles.require_operator(request.user, "change the planner's controls")
    control = PlannerControl.load()
    before = {name: getattr(control, name) for name in PlannerControlForm.Meta.fields}
    form = PlannerControlForm(request.POST, instance=PlannerControl.load())
    if not form.is_valid():
        messages.error(request, "Planner controls not changed: " + "; ".join(
            f"{field}: {' '.join(errors)}" for field, errors in form.errors.items()))
        return redirect(f"{_console_url()}#planner")
    changes = {name: value for name, value in form.cleaned_data.items() if before[name] != value}
    if changes:
        try:
            actions.set_planner_control(request.user, **changes)
            messages.success(request, f"Planner: {actions.describe_changes(before, changes)}.")
        except ValidationError as exc:
            messages.error(request, "; ".join(exc.messages))
    else:
        messages.info(request, "Planner controls unchanged.")
    return redirect(f"{_console_url()}#planner")


def _changed(data: dict[str, Any], instance: Any, editable: Iterable[str]) -> dict[str, Any]:
    """The editable fields an edit form's ``data`` changes on ``instance`` (what the action gets)."""
    return {k: data[k] for k in editable if k in data and data[k] != getattr(instance, k)}


@login_required
def reservation_edit(request: HttpRequest, pk: int | None = None) -> HttpResponse:
    """Create (pk None) or edit a reservation, with the action's validation on the form."""
    if not roles.has_any_role(request.user):
        return render(request, "jobs/no_role.html", status=403)
    roles.require_operator(request.user, "create or edit reservations")
    instance = get_object_or_404(Reservation.objects.select_related("job", "team"), pk=pk) if pk else None
    form = ReservationForm(request.POST or None, instance=instance)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            if instance is None:
                actions.create_reservation(request.user, **data)
                messages.success(request, f"Reservation {data['name']} created.")
            else:
                changes = _changed(data, instance, actions.RESERVATION_EDITABLE)
                if changes:
                    actions.update_reservation(instance, request.user, **changes)
                messages.success(request, f"Reservation {instance.name} saved.")
            return redirect(f"{_console_url()}#reservations")
        except ValidationError as exc:
            form.add_action_errors(exc)
    context = {**_page_context(request, "console"), "form": form, "instance": instance}
    return render(request, "jobs/reservation_form.html", context, status=400 if form.errors else 200)


@require_POST
@login_required
def reservation_cancel(request: HttpRequest, pk: int) -> HttpResponse:
    """End a reservation now (operators)."""
    reservation = get_object_or_404(Reservation, pk=pk)
    try:
        actions.cancel_reservation(reservation, request.user)
        messages.success(request, f"Reservation {reservation.name} cancelled.")
    except ValidationError as exc:
        messages.error(request, "; ".join(exc.messages))
    return redirect(f"{_console_url()}#reservations")


# -- teams (docs/teams.md) ------------------------------------------------------------------------


@require_GET
@any_role
def team_list(request: HttpRequest) -> HttpResponse:
    """Every team with its GPUs held now against its quota and borrowing limit (the console's bars),
    members and weight; kept current from the live cluster summary."""
    context = {**_page_context(request, "teams"), "teams": team_standings()}
    return render(request, "jobs/teams.html", context)


@require_GET
@any_role
def team_page(request: HttpRequest, pk: int) -> HttpResponse:
    """One team: its standing, members, GPUs held against its quota over time (the allocation
    history), its unfinished jobs as the viewer may see them, and its reservations."""
    team = get_object_or_404(Team.objects.select_related("parent"), pk=pk)
    range_key = request.GET.get("range", "24h")
    if range_key not in RANGES:
        range_key = "24h"
    now = timezone.now()
    detail = team_detail(team, request.user, now)
    usage = team_usage_series(team, now - RANGES[range_key], now)
    context = {
        **_page_context(request, "teams"),
        "team": team,
        "detail": detail,
        "children": list(team.children.order_by("name")),
        "range_key": range_key,
        "ranges": list(RANGES),
        "team_data": {
            "id": team.pk, "name": team.name, "since": usage["t"][0], "now": now.isoformat(), "usage": usage,
            "quota_gpus": team.quota_gpus, "borrow_limit_gpus": team.borrow_limit_gpus,
            # Operators' remove buttons, redrawn with each members refresh (omni.js teamPage).
            "members_url": reverse("team-page-members", args=[team.pk]) if roles.is_operator(request.user) else None,
        },
    }
    return render(request, "jobs/team_detail.html", context)


operator_only = role_required(roles.is_operator, "only operators change teams")


@operator_only
def team_edit(request: HttpRequest, pk: int | None = None) -> HttpResponse:
    """Create (pk None) or edit a team, with the action's validation on the form (400 when refused)."""
    instance = get_object_or_404(Team.objects.select_related("parent"), pk=pk) if pk else None
    form = TeamForm(request.POST or None, instance=instance)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            if instance is None:
                team = actions.create_team(request.user, **data)
                messages.success(request, f"Team {team.name} created.")
            else:
                changes = _changed(data, instance, actions.TEAM_EDITABLE)
                team = actions.edit_team(instance, request.user, **changes) if changes else instance
                messages.success(request, f"Team {team.name} saved." if changes else f"Team {team.name} unchanged.")
            return redirect("team-page", team.pk)
        except ValidationError as exc:
            form.add_action_errors(exc)
    context = {**_page_context(request, "teams"), "form": form, "instance": instance}
    return render(request, "jobs/team_form.html", context, status=400 if form.errors else 200)


@require_POST
@operator_only
def team_delete(request: HttpRequest, pk: int) -> HttpResponse:
    """Delete a team nothing names any more; while something does, say what on its page (the
    API answers that with 409)."""
    team = get_object_or_404(Team, pk=pk)
    try:
        actions.delete_team(team, request.user)
    except TeamInUse as exc:
        messages.error(request, f"Not deleted: {exc}.")
        return redirect("team-page", team.pk)
    messages.success(request, f"Team {team.name} deleted.")
    return redirect("teams")


@require_POST
@operator_only
def team_members(request: HttpRequest, pk: int) -> HttpResponse:
    """Add a member (``user``, ``default``), or with ``remove`` take one out."""
    team = get_object_or_404(Team, pk=pk)
    form = TeamMemberForm(request.POST)
    if not form.is_valid():
        messages.error(request, "; ".join(f"{e}" for errors in form.errors.values() for e in errors))
        return redirect(f"{team_url(team)}#team-members")
    user = form.cleaned_data["user"]
    try:
        if request.POST.get("remove"):
            actions.remove_team_member(team, request.user, user)
            messages.success(request, f"{user.get_username()} is no longer in team {team.name}.")
        else:
            actions.add_team_member(team, request.user, user, default=form.cleaned_data["default"])
            messages.success(request, f"{user.get_username()} added to team {team.name}.")
    except ValidationError as exc:
        messages.error(request, "; ".join(exc.messages))
    return redirect(f"{team_url(team)}#team-members")


def team_url(team: Team) -> str:
    return reverse("team-page", args=[team.pk])


# -- auditors: the review -----------------------------------------------------------------------


def _audit_queryset(form: AuditFilterForm):
    return form.filter(ElasticEvent.objects.all())


@require_GET
@audit_reader
def audit(request: HttpRequest) -> HttpResponse:
    """The elastic-adjustment log, filtered, newest first, keyset-paginated, chain status on top."""
    form = AuditFilterForm(request.GET)
    form.is_valid()
    queryset = _audit_queryset(form)
    before = request.GET.get("before")
    if before and before.isdigit():
        queryset = queryset.filter(id__lt=int(before))
    page = list(
        queryset.select_related("refers_to")
        .prefetch_related(Prefetch("outcomes", ElasticEvent.objects.order_by("id")))
        .order_by("-id")[: AUDIT_PAGE_SIZE + 1]
    )
    has_more = len(page) > AUDIT_PAGE_SIZE
    page = page[:AUDIT_PAGE_SIZE]
    query = request.GET.copy()
    query.pop("before", None)
    context = {
        **_page_context(request, "audit"),
        "form": form,
        "rows": [{"event": e, "text": describe_event(e, with_time=False), "payload": event_payload(e),
                  "gpus": _change(e.gpus_before, e.gpus_after),
                  "layout": _change(_layout(e.dp_before, e.accum_before), _layout(e.dp_after, e.accum_after)),
                  "nodes": compact_nodes(e.nodes_after or e.nodes_before),
                  "inputs": e.reason.get("inputs", {}) if isinstance(e.reason, dict) else {},
                  # For auditors: the stored reason and outcome exactly, behind a <details>.
                  "raw_json": json.dumps({"reason": e.reason, "outcome": e.outcome}, indent=2, sort_keys=True),
                  "outcomes": [{"event": o, "text": describe_event(o, with_time=False)} for o in e.outcomes.all()]}
                 for e in page],
        "next_before": page[-1].pk if has_more else None,
        "query": query.urlencode(),
        "chain": chain_status(),
        "filtered": form.active,
        "paged": bool(before),
    }
    return render(request, "jobs/audit.html", context)


def _layout(dp: int | None, accum: int | None) -> str | None:
    """"2×4" (DP × accumulation), "0" (no replica left: a stop), "2×·" (an old row without its
    accumulation), None (neither)."""
    if dp == 0:
        return "0"
    return None if dp is None and accum is None else f"{dp if dp is not None else '·'}×{accum if accum is not None else '·'}"


def _change(before: Any, after: Any) -> str:
    """"4 → 2", "→ 8" (nothing before), "4 →" (nothing after), "" (neither)."""
    if before is None and after is None:
        return ""
    if before is None:
        return f"→ {after}"
    if after is None:
        return f"{before} →"
    return str(before) if before == after else f"{before} → {after}"


def chain_status(budget_rows: int = CHAIN_VERIFY_BUDGET_ROWS) -> dict[str, Any]:
    """Verify the chain incrementally: rows already checked are remembered (their last hash),
    so each page load checks only what was appended since, at most ``budget_rows`` of it."""
    fresh = {"last_id": 0, "last_hash": GENESIS_HASH, "checked": 0, "bad": None}
    state = cache.get(CHAIN_CACHE_KEY) or fresh
    if state["last_id"] and not ElasticEvent.objects.filter(id=state["last_id"], hash=state["last_hash"]).exists():
        # The row we verified up to is gone or changed (a restored or rebuilt database): start over.
        state = dict(fresh)
    if state["bad"] is None:
        remaining = budget_rows
        while remaining > 0:
            chunk = list(ElasticEvent.objects.filter(id__gt=state["last_id"]).order_by("id")[: min(2000, remaining)])
            if not chunk:
                break
            for event in chunk:
                problem = link_problem(event, state["last_hash"])
                if problem:
                    state["bad"] = {"id": event.pk, "problem": problem}
                    break
                state.update(last_id=event.pk, last_hash=event.hash, checked=state["checked"] + 1)
            if state["bad"] is not None:
                break
            remaining -= len(chunk)
        # A break is re-checked after a minute (someone may restore the database); progress is kept.
        cache.set(CHAIN_CACHE_KEY, state, 60 if state["bad"] else 3600)
    total = ElasticEvent.objects.count()
    return {**state, "total": total, "complete": state["bad"] is None and state["checked"] >= total}


# Every hashed field (jobs.audit.HASHED_FIELDS) plus id, hash and mac, so anyone can recompute the
# chain from an export with tools/verify_audit_export.py, and whoever holds the audit key its MACs
# (docs/audit-log.md).
EXPORT_COLUMNS = (
    "id", "at", "kind", "job_id", "job_name", "actor", "actor_user_id", "planner_run", "command", "refers_to_id",
    "nodes_before", "nodes_after", "gpus_before", "gpus_after", "dp_before", "dp_after", "accum_before",
    "accum_after", "global_batch", "reason", "outcome", "prev_hash", "hash", "mac",
)


def _export_rows(queryset) -> Iterator[tuple]:
    """Rows in id order, fetched ``EXPORT_CHUNK_ROWS`` at a time by keyset: flat memory."""
    last_id = 0
    while True:
        chunk = list(queryset.filter(id__gt=last_id).order_by("id").values_list(*EXPORT_COLUMNS)[:EXPORT_CHUNK_ROWS])
        if not chunk:
            return
        yield from chunk
        last_id = chunk[-1][0]


def _plain(value: Any) -> Any:
    if hasattr(value, "isoformat"):
        return value.isoformat()
    if value is not None and not isinstance(value, (str, int, float, bool, list, dict)):
        return str(value)
    return value


class _Echo:
    """A file-like object whose write returns the line, for csv.writer in a streaming response."""

    def write(self, value: str) -> str:
        return value


def _csv_lines(queryset) -> Iterator[str]:
    writer = csv.writer(_Echo())
    yield writer.writerow(EXPORT_COLUMNS)
    for row in _export_rows(queryset):
        yield writer.writerow([
            json.dumps(v, sort_keys=True) if isinstance(v, (list, dict)) else ("" if v is None else _plain(v))
            for v in row
        ])


def _json_chunks(queryset) -> Iterator[str]:
    yield "["
    first = True
    for row in _export_rows(queryset):
        record = {name: _plain(value) for name, value in zip(EXPORT_COLUMNS, row, strict=True)}
        yield ("" if first else ",") + "\n" + json.dumps(record, sort_keys=True)
        first = False
    yield "\n]\n"


@require_GET
@audit_reader
def audit_export(request: HttpRequest, fmt: str) -> StreamingHttpResponse:
    """CSV or JSON of the filtered range, streamed (a million rows never sit in memory)."""
    form = AuditFilterForm(request.GET)
    queryset = _audit_queryset(form)
    stamp = timezone.now().strftime("%Y%m%dT%H%M%SZ")
    if fmt == "csv":
        response = StreamingHttpResponse(_csv_lines(queryset), content_type="text/csv; charset=utf-8")
    else:
        response = StreamingHttpResponse(_json_chunks(queryset), content_type="application/json")
    response["Content-Disposition"] = f'attachment; filename="omni-audit-{stamp}.{fmt}"'
    response["Cache-Control"] = "no-store"
    return response


# -- static: Plotly from the installed package ---------------------------------------------------

PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


@require_GET
def plotly_js(request: HttpRequest, version: str) -> FileResponse:
    """Plotly.js straight from the installed ``plotly`` package: no CDN, no 4.6 MB in git.

    The URL carries the package version, so browsers may cache it for a year.
    """
    if version != plotly.__version__ or not PLOTLY_JS.exists():
        raise Http404("no such Plotly build")
    response = FileResponse(PLOTLY_JS.open("rb"), content_type="text/javascript; charset=utf-8")
    response["Cache-Control"] = "public, max-age=31536000, immutable"
    return response


def bad_request(request, exception=None):
    """Django's 400 (a request it refused before any view: too many query or form fields, a
    malformed cookie or host): in words, as JSON under /api/ like every other API refusal, the
    default page elsewhere."""
    from django.views import defaults

    if request.path.startswith("/api/"):
        reason = str(exception) if exception is not None and str(exception) else "Bad request."
        return JsonResponse({"detail": reason}, status=400)
    return defaults.bad_request(request, exception)
