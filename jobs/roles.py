"""The three roles (Django groups made by a migration) and the checks every surface shares.

researcher: sees the cluster, acts on own jobs. operator: nodes, reservations, planner
controls, any job. auditor: read-only, plus the audit log and its export. Superusers count as
operators.

Who may see a job is one rule, :func:`job_visibility` (and :func:`visible_jobs`, the same rule
as a queryset filter): pages, the API, the live socket and every link ask it, so they cannot
disagree. Operators and auditors see every job in full, a researcher their own; what a
researcher sees of someone else's job is the operator's choice, ``OMNI_JOB_VISIBILITY``
(docs/live-ui.md): ``summary`` (the default, like Slurm's ``PrivateData=jobs``), ``all`` or
``own``.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

from django.conf import settings
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet

RESEARCHER = "researcher"
OPERATOR = "operator"
AUDITOR = "auditor"
ROLES = (RESEARCHER, OPERATOR, AUDITOR)


def role_names(user) -> frozenset[str]:
    if user is None or not user.is_authenticated:
        return frozenset()
    cached = getattr(user, "_omni_roles", None)
    if cached is None:
        cached = frozenset(user.groups.values_list("name", flat=True))
        if user.is_superuser:
            cached = cached | {OPERATOR}
        user._omni_roles = cached
    return cached


def is_operator(user) -> bool:
    return OPERATOR in role_names(user)


def is_auditor(user) -> bool:
    return AUDITOR in role_names(user)


def is_researcher(user) -> bool:
    return RESEARCHER in role_names(user)


def can_submit(user) -> bool:
    """Researchers and operators submit jobs; auditors only read (the API, the submit form)."""
    names = role_names(user)
    return RESEARCHER in names or OPERATOR in names


def has_any_role(user) -> bool:
    return bool(role_names(user))


def can_read_audit(user) -> bool:
    return is_operator(user) or is_auditor(user)


def can_act_on_job(user, job) -> bool:
    """Operators act on any job; researchers on their own; auditors on none."""
    if is_operator(user):
        return True
    return is_researcher(user) and job.owner_id == user.pk


def require_operator(user, what: str) -> None:
    if not is_operator(user):
        raise PermissionDenied(f"only operators may {what}")


def require_job_actor(user, job, what: str) -> None:
    if not can_act_on_job(user, job):
        raise PermissionDenied(f"you may not {what} job {job.name!r}: it is not yours and you are not an operator")


# -- who may see a job ---------------------------------------------------------------------------


class Visibility(IntEnum):
    """How much of a job a user may see; a larger value includes the smaller ones."""

    NONE = 0  # not even that it exists (a 404)
    SUMMARY = 1  # a row in lists: SUMMARY_FIELDS, no link to its page
    FULL = 2  # its page, its events, its telemetry, its live stream


# What a researcher sees of other people's jobs, per OMNI_JOB_VISIBILITY (omniweb/settings.py).
OTHERS_JOBS = {"summary": Visibility.SUMMARY, "all": Visibility.FULL, "own": Visibility.NONE}
# A summary: who runs what, at which class, in which state, on how many GPUs. Labels are the same
# fields in words; "visibility" says the rest was left out. A list of what is kept, not of what
# is dropped, so a field added to the job's record (its workload: entrypoint, workdir, env; its
# failure and log lines) stays its owner's until it is named here.
SUMMARY_FIELDS = ("id", "name", "owner", "priority", "priority_label", "state", "state_label", "gpus",
                  "borrowed_gpus")
# How a job the viewer may not see at all is named where a GPU or a reservation refers to it.
HIDDEN_JOB = "another user's job"


def owner_visibility(user, owner_id: int | None) -> Visibility:
    """How much ``user`` sees of a job owned by ``owner_id`` (None: by someone else)."""
    names = role_names(user)
    if OPERATOR in names or AUDITOR in names:
        return Visibility.FULL
    if RESEARCHER not in names:
        return Visibility.NONE
    if owner_id is not None and owner_id == user.pk:
        return Visibility.FULL
    return OTHERS_JOBS[settings.OMNI_JOB_VISIBILITY]


def job_visibility(user, job) -> Visibility:
    """How much ``user`` sees of ``job`` (anything with an ``owner_id``)."""
    return owner_visibility(user, job.owner_id)


def visible_jobs(user, queryset: QuerySet, at_least: Visibility = Visibility.SUMMARY, *, via: str = "") -> QuerySet:
    """``queryset`` cut to the jobs ``user`` sees at ``at_least`` or more: the same rule as a filter.

    ``via`` names the foreign key to the job when the rows are not jobs (``"job"`` for audit
    rows); rows without a job are then left out.
    """
    if via:
        queryset = queryset.filter(**{f"{via}__isnull": False})
    prefix = f"{via}__" if via else ""
    if owner_visibility(user, None) >= at_least:
        return queryset
    if owner_visibility(user, user.pk) >= at_least:
        return queryset.filter(**{f"{prefix}owner_id": user.pk})
    return queryset.none()


def summarise(record: dict[str, Any]) -> dict[str, Any]:
    """A job's record (API or live payload) cut to its summary fields, marked as a summary."""
    return {**{name: record[name] for name in SUMMARY_FIELDS if name in record}, "visibility": "summary"}


def job_name_for(user, name: str, owner_id: int | None) -> str:
    """The job's name where it appears beside something else (a GPU, a reservation), if ``user`` may know it."""
    return name if owner_visibility(user, owner_id) >= Visibility.SUMMARY else HIDDEN_JOB
