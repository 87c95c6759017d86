"""What the pages, the API and the live cluster summary read of teams (docs/teams.md): each team's
standing now (GPUs held against its quota and borrowing limit) and its usage over time.

One answer for every surface: the API's team list, the Teams page, the Cluster page's team bars
(``cluster_summary["teams"]``, streamed live) and so the CLI all read ``team_standings``.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.db.models import Count, Min, Q, Sum
from django.utils import timezone

from jobs.models import Allocation, AllocationSpan, Node, Team
from jobs.planner.wording import plural


def team_tree(teams: Iterable[Team]) -> dict[int, list[int]]:
    """Each team id -> the ids of the team and every team inside it (a cycle cannot be saved,
    but a walk that met one would stop)."""
    teams = list(teams)
    parent_of = {t.pk: t.parent_id for t in teams}
    covers: dict[int, list[int]] = {t.pk: [] for t in teams}
    for team in teams:
        seen: set[int] = set()
        at: int | None = team.pk
        while at is not None and at in covers and at not in seen:
            seen.add(at)
            covers[at].append(team.pk)
            at = parent_of.get(at)
    return covers


def standing_words(held: int, quota: int, limit: int | None) -> str:
    """``24 of 32 guaranteed GPUs``, ``40 GPUs: 8 borrowed beyond its quota of 32 (up to 16)``."""
    if held <= quota:
        text = f"{held} of {quota} guaranteed GPUs"
    else:
        text = f"{plural(held, 'GPU')}: {held - quota} borrowed beyond its quota of {quota}"
    if limit is None:
        return text + "; may borrow any idle GPU"
    if limit == 0:
        return text + "; may not borrow"
    return text + f"; may borrow up to {limit}"


def team_bar(held: int, quota: int, limit: int | None, gpus_total: int) -> dict[str, float]:
    """Where a team's bar is filled, in percent of its track: held within the quota, borrowed
    beyond it, and the quota's mark. The track is quota + borrowing limit (the most it may hold),
    the cluster for a team without a limit."""
    scale = max(quota + limit if limit is not None else gpus_total, held, quota, 1)
    return {"within_pct": round(100 * min(held, quota) / scale, 2),
            "borrowed_pct": round(100 * max(0, held - quota) / scale, 2),
            "quota_pct": round(100 * quota / scale, 2), "scale_gpus": scale}


def team_standings(teams: Iterable[Team] | None = None, *, gpus_total: int | None = None) -> list[dict[str, Any]]:
    """Every team (or those given: all of them, ``members_count`` annotated, for a parent's sums) with the
    GPUs it holds now against its quota, its own jobs' and its teams' together, as the planner
    counts them (``quota.TeamBook``); ``gpus_on_loan``: beside them, the GPUs other teams'
    reservations lend its jobs, which count against no quota. Two queries when
    ``teams`` is None, whatever the number of teams (and one for the cluster's size unless
    ``gpus_total`` is given)."""
    if teams is None:
        teams = Team.objects.annotate(members_count=Count("memberships")).order_by("name")
    teams = list(teams)
    if not teams:
        return []
    names = {t.pk: t.name for t in teams}
    held_own: dict[int, int] = {}
    loaned_own: dict[int, int] = {}
    # Grouped by whose reservation lent the GPU (its team, or its job's): a GPU lent by another
    # team's reservation is not held against the quota (``quota.charged_gpus``).
    for row in (Allocation.objects.filter(job__team__isnull=False).order_by()
                .values("job__team_id", "borrowed_from__team_id", "borrowed_from__job__team_id")
                .annotate(n=Count("id"), loaned=Count("id", filter=Q(borrowed_from__isnull=False)))):
        team_id = row["job__team_id"]
        lender = row["borrowed_from__team_id"] or row["borrowed_from__job__team_id"]
        uncharged = row["loaned"] if lender != team_id else 0
        held_own[team_id] = held_own.get(team_id, 0) + row["n"] - uncharged
        loaned_own[team_id] = loaned_own.get(team_id, 0) + uncharged
    if gpus_total is None and teams:
        gpus_total = Node.objects.aggregate(n=Sum("gpu_count"))["n"] or 0
    covers = team_tree(teams)
    rows = []
    for team in teams:
        held = sum(held_own.get(pk, 0) for pk in covers[team.pk])
        limit = team.borrow_limit_gpus
        rows.append({
            "id": team.pk,
            "name": team.name,
            "parent": names.get(team.parent_id) if team.parent_id else None,
            "quota_gpus": team.quota_gpus,
            "borrow_limit_gpus": limit,
            "weight": team.weight,
            "members_count": getattr(team, "members_count", None),
            "gpus_held": held,
            "gpus_on_loan": sum(loaned_own.get(pk, 0) for pk in covers[team.pk]),
            "gpus_borrowed": max(0, held - team.quota_gpus),
            # What it may still take in all, quota and borrowing together (None: no limit).
            "gpus_may_take": None if limit is None else max(0, team.quota_gpus + limit - held),
            "words": standing_words(held, team.quota_gpus, limit),
            "bar": team_bar(held, team.quota_gpus, limit, gpus_total or 0),
        })
    return rows


def team_usage_series(team: Team, since: datetime, now: datetime | None = None) -> dict[str, list]:
    """The GPUs the team (its teams included) held over ``[since, now]``, a step at every change,
    from the allocation history (``AllocationSpan``): ``t`` (ISO times) and ``gpus``. The series
    begins no earlier than the oldest of those teams was created or the first GPU their jobs
    held, whichever came first, so a team made an hour ago is drawn over that hour, not as a day
    of nothing with its history at the right edge."""
    now = now or timezone.now()
    ids = team_tree(Team.objects.only("id", "parent_id"))[team.pk]
    spans = list(AllocationSpan.objects.filter(job__team__in=ids).overlapping(since, now)
                 .values_list("started_at", "ended_at"))
    created = Team.objects.filter(pk__in=ids).aggregate(first=Min("created_at"))["first"]
    if created is not None:
        since = min(max(since, min([created] + [started_at for started_at, _ in spans])), now)
    changes: dict[datetime, int] = {}
    held_at_start = 0
    for started_at, ended_at in spans:
        if started_at <= since:
            held_at_start += 1
        else:
            changes[started_at] = changes.get(started_at, 0) + 1
        if ended_at is not None and ended_at <= now:
            changes[ended_at] = changes.get(ended_at, 0) - 1
    times, gpus = [since], [held_at_start]
    held = held_at_start
    for at in sorted(changes):
        held += changes[at]
        times.append(at)
        gpus.append(held)
    times.append(now)
    gpus.append(held)
    return {"t": [t.isoformat() for t in times], "gpus": gpus}


def team_jobs_filter(team: Team) -> Q:
    """The jobs of the team and of every team inside it."""
    return Q(team__in=team_tree(Team.objects.only("id", "parent_id"))[team.pk])


def team_detail(team: Team, user, now: datetime | None = None) -> dict[str, Any]:
    """A team's page and its API detail: its standing, members, unfinished jobs (its teams'
    too, each as ``roles.job_visibility`` lets ``user`` see it: in full, as a summary, or not at
    all) and live reservations (its own and its jobs'). Six queries."""
    from jobs import roles
    from jobs.models import Job, Reservation
    from jobs.models.jobs import TERMINAL_JOB_STATES

    now = now or timezone.now()
    standing = next(row for row in team_standings() if row["id"] == team.pk)
    members = [{"user": m.user.get_username(), "default": m.is_default, "since": m.created_at.isoformat()}
               for m in team.memberships.select_related("user").order_by("user__username")]
    jobs = (Job.objects.filter(team_jobs_filter(team)).exclude(state__in=TERMINAL_JOB_STATES)
            .select_related("owner", "team").annotate(held=Count("allocations"),
                                                      on_loan=Count("allocations", filter=Q(allocations__borrowed_from__isnull=False)))
            .order_by("submitted_at", "id"))
    job_rows = []
    for job in roles.visible_jobs(user, jobs):
        record = {"id": job.pk, "name": job.name, "owner": job.owner.get_username(), "priority": job.priority,
                  "priority_label": job.get_priority_display(), "state": job.state, "state_label": job.get_state_display(),
                  "gpus": job.held, "borrowed_gpus": job.on_loan, "team": job.team.name, "gpus_wanted": job.gpus_wanted,
                  "pending_reason": job.pending_reason}
        seen = roles.job_visibility(user, job)
        job_rows.append({**record, "visibility": "full"} if seen is roles.Visibility.FULL else roles.summarise(record))
    reservations = (Reservation.objects.in_force(now).filter(Q(team=team) | Q(job__team=team))
                    .select_related("job", "team").order_by("start_at", "id"))
    reservation_rows = [{
        "id": r.pk, "name": r.name, "team": r.team.name if r.team_id else None,
        "job": (roles.job_name_for(user, r.job.name, r.job.owner_id) if r.job_id else None),
        "gpus": r.gpus, "spares": r.spares, "start_at": r.start_at.isoformat(),
        "end_at": r.end_at.isoformat() if r.end_at else None, "period_s": r.period_s, "active_s": r.active_s,
        "active_now": r.is_active_at(now),
    } for r in reservations]
    return {**standing, "members": members, "jobs": job_rows, "reservations": reservation_rows}
