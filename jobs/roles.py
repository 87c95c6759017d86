"""The three roles (Django groups made by a migration) and the checks every surface shares.

researcher: sees the cluster, acts on own jobs. operator: nodes, reservations, planner
controls, any job. auditor: read-only, plus the audit log and its export. Superusers count as
operators.
"""

from __future__ import annotations

from django.core.exceptions import PermissionDenied

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
