"""Teams and their members (docs/teams.md): an operator creates, edits and deletes teams, adds and
removes members and sets a member's default team; each change is one audit row whose reason
holds what changed (``inputs.before`` / ``inputs.after``).

Refusals: a bad value or a parent that would make a cycle is a ``ValidationError`` per field (the
API's 400), another role a ``PermissionDenied`` (403), deleting a team that jobs, reservations or
other teams still name a ``TeamInUse`` (409).
"""

from __future__ import annotations

import math
import re
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction

from jobs.actions._common import actor_name, describe_changes
from jobs.actions.edits import FieldErrors
from jobs.audit import record_event
from jobs.models import Reservation, Team, TeamInUse, TeamMembership
from jobs.roles import require_operator
from jobs.vocab import EventKind

TEAM_EDITABLE = ("parent", "quota_gpus", "borrow_limit_gpus", "weight")
TEAM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
# Past this a number is a typo, not a cluster (and JSON numbers stay exact).
GPUS_MAX = 1_000_000
WEIGHT_MAX = 1000.0


def team_facts(team: Team) -> dict[str, Any]:
    """What an audit row says of a team's settings."""
    return {
        "parent": team.parent.name if team.parent_id else None,
        "quota_gpus": team.quota_gpus,
        "borrow_limit_gpus": team.borrow_limit_gpus,
        "weight": team.weight,
    }


def team_problems(team: Team) -> FieldErrors:
    """Why ``team`` cannot be saved as it is, by field; {} if it can. A parent whose chain leads
    back to the team would make a cycle: the planner would count its jobs against themselves."""
    errors: FieldErrors = {}
    if not isinstance(team.name, str) or not TEAM_NAME.match(team.name):
        errors["name"] = ["1 to 64 letters, digits, - and _, starting with a letter or digit"]
    elif Team.objects.filter(name=team.name).exclude(pk=team.pk).exists():
        errors["name"] = [f"a team named {team.name!r} already exists"]
    if not isinstance(team.quota_gpus, int) or not 0 <= team.quota_gpus <= GPUS_MAX:
        errors["quota_gpus"] = [f"a whole number of GPUs from 0 to {GPUS_MAX}"]
    if team.borrow_limit_gpus is not None and (
            not isinstance(team.borrow_limit_gpus, int) or not 0 <= team.borrow_limit_gpus <= GPUS_MAX):
        errors["borrow_limit_gpus"] = [f"a whole number of GPUs from 0 to {GPUS_MAX}, or empty for no limit"]
    if not isinstance(team.weight, int | float) or not math.isfinite(team.weight) or not 0 < team.weight <= WEIGHT_MAX:
        errors["weight"] = [f"more than 0 and at most {WEIGHT_MAX:g}"]
    if team.parent_id is not None:
        if team.pk is not None and team.parent_id == team.pk:
            errors["parent"] = [f"team {team.name} cannot be its own parent"]
        elif team.pk is not None and any(t.pk == team.pk for t in team.parent.ancestors()):
            errors["parent"] = [f"team {team.parent.name} is inside team {team.name}: that would make a cycle"]
    return errors


def _record_team_event(kind: EventKind, actor, text: str, inputs: dict[str, Any]) -> None:
    """The audit row of a team write; ``text`` goes on from the actor's name."""
    record_event(kind, actor=actor_name(actor), actor_user=actor,
                 reason={"rule": kind.value, "text": f"{actor_name(actor)} {text}", "inputs": inputs})


def _quota_words(team: Team) -> str:
    limit = "no borrowing limit" if team.borrow_limit_gpus is None else f"may borrow {team.borrow_limit_gpus} more"
    inside = f", inside {team.parent.name}" if team.parent_id else ""
    return f"quota {team.quota_gpus} GPUs, {limit}, weight {team.weight:g}{inside}"


@transaction.atomic
def create_team(actor, *, name: str, parent: Team | None = None, quota_gpus: int = 0,
                borrow_limit_gpus: int | None = None, weight: float = 1.0) -> Team:
    """A new team (an organisation when others are put inside it)."""
    require_operator(actor, "create teams")
    team = Team(name=name, parent=parent, quota_gpus=quota_gpus, borrow_limit_gpus=borrow_limit_gpus, weight=weight)
    if errors := team_problems(team):
        raise ValidationError(errors)
    team.save()
    _record_team_event(EventKind.TEAM_CREATED, actor, f"created team {team.name} ({_quota_words(team)}).",
                       {"team": team.name, "before": None, "after": team_facts(team)})
    return team


@transaction.atomic
def edit_team(team: Team, actor, **changes: Any) -> Team:
    """Change a team's parent, quota, borrowing limit or weight; a change of nothing writes nothing."""
    require_operator(actor, "edit teams")
    if unknown := set(changes) - set(TEAM_EDITABLE):
        raise ValidationError({field: ["this field cannot be changed"] for field in sorted(unknown)})
    team = Team.objects.select_for_update(no_key=True).get(pk=team.pk)
    before = team_facts(team)
    for field, value in changes.items():
        setattr(team, field, value)
    if errors := team_problems(team):
        raise ValidationError(errors)
    after = team_facts(team)
    changed = [field for field in TEAM_EDITABLE if before[field] != after[field]]
    if not changed:
        return team
    team.save(update_fields=changed)
    was = {f: before[f] for f in changed}
    now = {f: after[f] for f in changed}
    _record_team_event(EventKind.TEAM_EDITED, actor, f"changed team {team.name}: {describe_changes(was, now)}.",
                       {"team": team.name, "before": was, "after": now})
    return team


def team_holders(team: Team) -> dict[str, int]:
    """What still names the team: its unfinished and finished jobs, reservations, and the teams inside it."""
    return {
        "jobs": team.jobs.count(),
        "reservations": Reservation.objects.filter(team=team).count(),
        "teams inside it": team.children.count(),
    }


@transaction.atomic
def delete_team(team: Team, actor) -> None:
    """Delete a team that no job, reservation or other team names (its memberships go with it).
    A job's team is its history (what it ran under, whose usage it was): such a team stays."""
    require_operator(actor, "delete teams")
    team = Team.objects.select_for_update(no_key=True).get(pk=team.pk)
    holders = team_holders(team)
    if any(holders.values()):
        raise TeamInUse(team, holders)
    facts = team_facts(team)
    members = list(team.memberships.order_by("user__username").values_list("user__username", flat=True))
    name = team.name
    team.delete()
    _record_team_event(EventKind.TEAM_DELETED, actor, f"deleted team {name}.",
                       {"team": name, "before": {**facts, "members": members}, "after": None})


@transaction.atomic
def add_team_member(team: Team, actor, user, *, default: bool = False) -> TeamMembership:
    """Put ``user`` in ``team``; their first team becomes their default one."""
    require_operator(actor, "change team members")
    if TeamMembership.objects.filter(team=team, user=user).exists():
        raise ValidationError({"user": [f"{user.get_username()} is already in team {team.name}"]})
    current = TeamMembership.objects.select_for_update(no_key=True).filter(user=user, is_default=True).first()
    make_default = default or current is None
    if make_default and current is not None:
        current.is_default = False
        current.save(update_fields=["is_default"])
    membership = TeamMembership.objects.create(team=team, user=user, is_default=make_default)
    _record_team_event(
        EventKind.TEAM_MEMBER_ADDED, actor,
        f"added {user.get_username()} to team {team.name}{' (their default team)' if make_default else ''}.",
        {"team": team.name, "user": user.get_username(),
         "before": {"default_team": current.team.name if current else None},
         "after": {"default_team": team.name if make_default else (current.team.name if current else None)}},
    )
    return membership


@transaction.atomic
def remove_team_member(team: Team, actor, user) -> None:
    """Take ``user`` out of ``team``. If it was their default team, their oldest other team becomes
    the default (none: their submits go to no team). Their jobs keep the team they ran under."""
    require_operator(actor, "change team members")
    membership = TeamMembership.objects.select_for_update(no_key=True).filter(team=team, user=user).first()
    if membership is None:
        raise ValidationError({"user": [f"{user.get_username()} is not in team {team.name}"]})
    default_before = default_team_name(user)
    membership.delete()
    if membership.is_default:
        successor = TeamMembership.objects.filter(user=user).order_by("created_at", "id").first()
        if successor is not None:
            successor.is_default = True
            successor.save(update_fields=["is_default"])
    default_after = default_team_name(user)
    tail = ""
    if default_after != default_before:
        tail = f"; their default team is now {default_after}" if default_after else "; they have no default team now"
    _record_team_event(
        EventKind.TEAM_MEMBER_REMOVED, actor, f"removed {user.get_username()} from team {team.name}{tail}.",
        {"team": team.name, "user": user.get_username(),
         "before": {"default_team": default_before}, "after": {"default_team": default_after}},
    )


@transaction.atomic
def set_default_team(actor, user, team: Team) -> TeamMembership:
    """Make ``team`` (one they are in) the team ``user``'s submits go to when they name none."""
    require_operator(actor, "set default teams")
    memberships = {m.team_id: m for m in TeamMembership.objects.select_for_update(no_key=True).filter(user=user)
                   .select_related("team")}
    chosen = memberships.get(team.pk)
    if chosen is None:
        raise ValidationError({"team": [f"{user.get_username()} is not in team {team.name}: add them first"]})
    current = next((m for m in memberships.values() if m.is_default), None)
    if current is chosen:
        return chosen
    if current is not None:
        current.is_default = False
        current.save(update_fields=["is_default"])
    chosen.is_default = True
    chosen.save(update_fields=["is_default"])
    _record_team_event(
        EventKind.TEAM_DEFAULT_SET, actor, f"made team {team.name} {user.get_username()}'s default team.",
        {"team": team.name, "user": user.get_username(),
         "before": {"default_team": current.team.name if current else None}, "after": {"default_team": team.name}},
    )
    return chosen


# -- reading: what submit and the pages ask -------------------------------------------------------

def default_team(user) -> Team | None:
    """The team a submit by ``user`` that names none goes to."""
    membership = TeamMembership.objects.filter(user=user, is_default=True).select_related("team").first()
    return membership.team if membership else None


def default_team_name(user) -> str | None:
    team = default_team(user)
    return team.name if team else None


def is_member(user, team: Team) -> bool:
    return TeamMembership.objects.filter(user=user, team=team).exists()

