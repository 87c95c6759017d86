"""Teams: who shares the cluster, with a guaranteed quota of GPUs, a borrowing limit beyond it and
a weight among borrowers; an organisation is a team with teams inside it (docs/teams.md).

The planner reads them as ``jobs.planner.snapshot.Team`` (``jobs/snapshot.py``); every change is
an audited action in ``jobs/actions/teams.py``.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import F, Q

from jobs.planner.wording import agree


class TeamInUse(Exception):
    """A team that jobs, reservations or other teams still name cannot be deleted (the API's 409)."""

    def __init__(self, team: Team, holders: dict[str, int]) -> None:
        self.team = team
        self.holders = holders
        one = {"jobs": "job", "reservations": "reservation", "teams inside it": "team inside it"}
        words = ", ".join(f"{n} {agree(n, one.get(what, what), what)}" for what, n in holders.items() if n)
        super().__init__(f"team {team.name} still has {words}: move or finish them first")


class Team(models.Model):
    """A team (or, with ``parent`` empty and teams inside it, an organisation).

    ``quota_gpus`` are guaranteed to its jobs; beyond them it may borrow idle GPUs up to
    ``borrow_limit_gpus`` more (empty: no limit), and among borrowers the one with least past
    usage per ``weight`` goes first. A child's jobs count against its parent's quota and limit too.
    """

    name = models.SlugField(max_length=64, unique=True, help_text="Letters, digits, - and _; how jobs name it.")
    parent = models.ForeignKey(
        "self", on_delete=models.PROTECT, null=True, blank=True, related_name="children",
        help_text="The organisation (or larger team) it belongs to; its jobs count against that one's quota too.",
    )
    quota_gpus = models.PositiveIntegerField(default=0, help_text="GPUs guaranteed to its jobs.")
    borrow_limit_gpus = models.PositiveIntegerField(
        null=True, blank=True, help_text="How many GPUs beyond its quota it may borrow while others' are idle; empty: any.",
    )
    weight = models.FloatField(default=1.0, help_text="Its share among borrowers (past usage is divided by it).")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(condition=Q(weight__gt=0), name="team_weight_positive"),
            models.CheckConstraint(condition=~Q(parent=F("id")), name="team_not_its_own_parent"),
        ]

    def __str__(self) -> str:
        return self.name

    def ancestors(self) -> list[Team]:
        """The enclosing teams, innermost first (a query each; the chains are two or three long)."""
        chain: list[Team] = []
        seen = {self.pk}
        team = self.parent
        while team is not None and team.pk not in seen:
            chain.append(team)
            seen.add(team.pk)
            team = team.parent
        return chain


class TeamMembership(models.Model):
    """A user in a team. A user may be in several; the one marked default is where their jobs go
    when a submit names no team."""

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="team_memberships")
    is_default = models.BooleanField(default=False, help_text="The team a submit without one goes to.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["team__name", "user__username"]
        constraints = [
            models.UniqueConstraint(fields=["team", "user"], name="one_membership_per_team"),
            models.UniqueConstraint(fields=["user"], condition=Q(is_default=True), name="one_default_team_per_user"),
        ]

    def __str__(self) -> str:
        return f"{self.user} in {self.team}{' (default)' if self.is_default else ''}"
