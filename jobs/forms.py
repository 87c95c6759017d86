"""Forms of the live pages: filters (dashboard, audit), the submit form and the operator's edits.

Forms only parse and check single fields; cross-field rules live in ``jobs.actions`` so the
API, the admin and these pages refuse the same things with the same words.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from django import forms
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db.models import Q, TextField
from django.db.models.functions import Cast

from jobs import roles
from jobs.actions import jobs as job_actions
from jobs.models import (
    REFERENCE_ENTRYPOINT,
    Integration,
    Job,
    JobState,
    PlannerControl,
    Priority,
    Reservation,
    Team,
)
from jobs.vocab import EVENT_KIND_LABELS, choices

STATE_GROUPS = {
    "active": ("running", "checkpointing", "resizing", "recovering", "pending", "preempted"),
    "running": ("running", "checkpointing", "resizing", "recovering"),
    "waiting": ("pending", "preempted"),
    "finished": ("completed", "failed", "cancelled"),
}


class JobFilterForm(forms.Form):
    """The dashboard's filters: which jobs, by state group or exact state, class, owner, name."""

    state = forms.ChoiceField(
        required=False,
        choices=[("", "Active and waiting"), ("running", "Running"), ("waiting", "Waiting"),
                 ("finished", "Finished"), ("all", "All")] + [(v, f"= {label}") for v, label in JobState.choices],
    )
    priority = forms.ChoiceField(required=False, choices=[("", "Any class"), *Priority.choices])
    q = forms.CharField(required=False, max_length=128, label="Name contains")
    mine = forms.ChoiceField(required=False, choices=[("", "Default"), ("1", "Mine"), ("0", "Everyone's")])

    def filter(self, queryset, user, default_mine: bool):
        """Apply the cleaned filters to a Job queryset."""
        data = self.cleaned_data if self.is_valid() else {}
        state = data.get("state") or ""
        if state in STATE_GROUPS:
            queryset = queryset.filter(state__in=STATE_GROUPS[state])
        elif state == "":
            queryset = queryset.filter(state__in=STATE_GROUPS["active"])
        elif state != "all":
            queryset = queryset.filter(state=state)
        if data.get("priority"):
            queryset = queryset.filter(priority=data["priority"])
        if data.get("q"):
            queryset = queryset.filter(name__icontains=data["q"])
        mine = data.get("mine", "")
        if mine == "1" or (mine == "" and default_mine):
            queryset = queryset.filter(owner=user)
        return queryset


class AuditFilterForm(forms.Form):
    """The auditor's filters; the same set drives the table and both exports."""

    since = forms.DateTimeField(required=False, label="From (UTC)",
                                widget=forms.DateTimeInput(attrs={"type": "datetime-local"}))
    until = forms.DateTimeField(required=False, label="Until (UTC)",
                                widget=forms.DateTimeInput(attrs={"type": "datetime-local"}))
    job = forms.CharField(required=False, max_length=128)
    node = forms.CharField(required=False, max_length=64)
    kind = forms.MultipleChoiceField(required=False, choices=choices(EVENT_KIND_LABELS), widget=forms.CheckboxSelectMultiple)
    actor = forms.CharField(required=False, max_length=150)
    planner_run = forms.UUIDField(required=False)

    def filter(self, queryset):
        """Apply the cleaned filters to an ElasticEvent queryset (invalid filters match nothing)."""
        if not self.is_valid():
            return queryset.none()
        data = self.cleaned_data
        if data.get("since"):
            queryset = queryset.filter(at__gte=data["since"])
        if data.get("until"):
            queryset = queryset.filter(at__lt=data["until"])
        if data.get("job"):
            queryset = queryset.filter(job_name=data["job"])
        if data.get("node"):
            # A text match on the JSON lists works the same on PostgreSQL and SQLite.
            quoted = json.dumps(data["node"])
            queryset = queryset.annotate(
                nodes_before_text=Cast("nodes_before", TextField()),
                nodes_after_text=Cast("nodes_after", TextField()),
            ).filter(Q(nodes_before_text__contains=quoted) | Q(nodes_after_text__contains=quoted))
        if data.get("kind"):
            queryset = queryset.filter(kind__in=data["kind"])
        if data.get("actor"):
            queryset = queryset.filter(actor=data["actor"])
        if data.get("planner_run"):
            queryset = queryset.filter(planner_run=data["planner_run"])
        return queryset

    @property
    def active(self) -> bool:
        return self.is_valid() and any(self.cleaned_data.get(name) for name in self.fields)


class EnvField(forms.Field):
    """A job's extra environment as ``NAME=value`` lines, shown back as its names only.

    No value is ever rendered, not even one just typed into a form that comes back with an
    error (as a password input): a line ``NAME`` alone keeps the value the job has, ``NAME=value``
    sets it, and a name left out is removed. What a name may be is ``workload_problems``'s rule.
    """

    widget = forms.Textarea(attrs={"rows": 4, "spellcheck": "false"})

    def __init__(self, *, current: dict[str, str] | None = None, **kwargs: Any) -> None:
        self.current = dict(current or {})
        kwargs.setdefault("required", False)
        kwargs.setdefault("help_text", "One variable a line: NAME=value sets it, NAME alone keeps its value, "
                                       "a name left out is removed. Values are never shown.")
        super().__init__(**kwargs)

    def prepare_value(self, value: Any) -> str:
        if isinstance(value, dict):
            return "\n".join(sorted(value))
        return "\n".join(line.partition("=")[0].strip() for line in str(value or "").splitlines() if line.strip())

    def to_python(self, value: Any) -> dict[str, str]:
        if isinstance(value, dict):
            return value
        env: dict[str, str] = {}
        for number, line in enumerate(str(value or "").splitlines(), 1):
            if not line.strip():
                continue
            name, assigns, text = line.partition("=")
            name = name.strip()
            if name in env:
                raise ValidationError(f"line {number}: {name} is listed twice")
            if assigns:
                env[name] = text
            elif name in self.current:
                env[name] = self.current[name]
            else:
                raise ValidationError(f"line {number}: {name} has no value yet: write {name}=VALUE")
        return env

    def has_changed(self, initial: Any, data: Any) -> bool:
        try:
            return self.to_python(data) != (initial or {})
        except ValidationError:
            return True


class PlannerControlForm(forms.ModelForm):
    """Pause, dry run and the knobs; only changed fields are sent to set_planner_control."""

    class Meta:
        model = PlannerControl
        fields = ["paused", "dry_run", "safety_factor", "min_run_s", "reclaim_grace_s"]
        labels = {
            "safety_factor": "Safety factor (x checkpoint time)",
            "min_run_s": "Minimum run before preemption (s)",
            "reclaim_grace_s": "Reclaim grace (s)",
        }
        widgets = {"safety_factor": forms.NumberInput(attrs={"step": "0.1", "min": "1", "max": "10"})}


class ActionErrorsMixin:
    """A form an action validates after it: the action's ValidationError lands on the fields it
    names (the rest on the form as a whole)."""

    def add_action_errors(self, error: ValidationError) -> None:
        if hasattr(error, "error_dict"):
            for field, messages in error.message_dict.items():
                self.add_error(field if field in self.fields else None, messages)
        else:
            self.add_error(None, error.messages)


class ReservationForm(ActionErrorsMixin, forms.Form):
    """Create or edit a reservation; a recurring one has both a period and an active span."""

    name = forms.SlugField(max_length=128)
    job = forms.ModelChoiceField(queryset=Job.objects.filter(priority=Priority.CRITICAL).order_by("name"),
                                 required=False, help_text="A critical job, or leave empty and choose a team.")
    team = forms.ModelChoiceField(queryset=Team.objects.order_by("name"), required=False,
                                  help_text="A team's reservation: for whichever of its critical jobs runs; it outlives them.")
    gpus = forms.IntegerField(min_value=1, label="GPUs")
    spares = forms.IntegerField(min_value=0, initial=0)
    start_at = forms.DateTimeField(label="Start (UTC)", widget=forms.DateTimeInput(attrs={"type": "datetime-local"}))
    end_at = forms.DateTimeField(required=False, label="End (UTC, blank = open)",
                                 widget=forms.DateTimeInput(attrs={"type": "datetime-local"}))
    period_s = forms.IntegerField(required=False, min_value=60, label="Repeats every (s)")
    active_s = forms.IntegerField(required=False, min_value=1, label="Active for (s) of each period")

    def __init__(self, *args: Any, instance: Reservation | None = None, **kwargs: Any):
        self.instance = instance
        if instance is not None and "initial" not in kwargs:
            kwargs["initial"] = {
                "name": instance.name, "job": instance.job_id, "team": instance.team_id, "gpus": instance.gpus, "spares": instance.spares,
                "start_at": instance.start_at.strftime("%Y-%m-%dT%H:%M"),
                "end_at": instance.end_at.strftime("%Y-%m-%dT%H:%M") if instance.end_at else None,
                "period_s": instance.period_s, "active_s": instance.active_s,
            }
        super().__init__(*args, **kwargs)
        if instance is not None:
            # Name and job identify a reservation; editing changes its size and windows only.
            self.fields["name"].disabled = True
            self.fields["job"].disabled = True

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if (data.get("period_s") is None) != (data.get("active_s") is None):
            raise ValidationError("A recurring reservation needs both 'repeats every' and 'active for'.")
        return data



class TeamForm(ActionErrorsMixin, forms.Form):
    """Create or edit a team (operators; ``jobs.actions.teams`` checks every rule and records the
    audit row). A team's name is fixed once made: editing changes its place and its numbers."""

    name = forms.CharField(max_length=64, help_text="Letters, digits, - and _; fixed once made.")
    parent = forms.ModelChoiceField(queryset=Team.objects.order_by("name"), required=False, label="Inside",
                                    help_text="The enclosing team (an organisation), or none.")
    quota_gpus = forms.IntegerField(min_value=0, initial=0, label="Quota (GPUs)",
                                    help_text="Guaranteed GPUs: a team below its quota takes borrowed GPUs back.")
    borrow_limit_gpus = forms.IntegerField(min_value=0, required=False, label="Borrowing limit (GPUs)",
                                           help_text="How many idle GPUs beyond its quota it may hold; empty: no limit.")
    weight = forms.FloatField(min_value=0.001, initial=1.0, help_text="Its share of idle GPUs against other teams'.")

    def __init__(self, *args: Any, instance: Team | None = None, **kwargs: Any):
        self.instance = instance
        if instance is not None and "initial" not in kwargs:
            kwargs["initial"] = {"name": instance.name, "parent": instance.parent_id, "quota_gpus": instance.quota_gpus,
                                 "borrow_limit_gpus": instance.borrow_limit_gpus, "weight": instance.weight}
        super().__init__(*args, **kwargs)
        if instance is not None:
            self.fields["name"].disabled = True
            self.fields["parent"].queryset = Team.objects.exclude(pk=instance.pk).order_by("name")


class TeamMemberForm(forms.Form):
    """Add a user to a team by user name."""

    user = forms.CharField(max_length=150, label="User name")
    default = forms.BooleanField(required=False, label="Make it their default team")

    def clean_user(self) -> Any:
        name = self.cleaned_data["user"].strip()
        user = get_user_model().objects.filter(username=name).first()
        if user is None:
            raise ValidationError(f"no user named {name!r}")
        return user


class SubmitJobForm(forms.Form):
    """The dashboard's submit form: one job's spec, each field parsed and range-checked here
    (the API serializer's ranges); everything across fields and against the cluster is
    ``submit_job``'s (``check_submission``), shown on the fields it names.

    The entrypoint is one shell-like line (``shlex``), the environment ``NAME=value`` lines whose
    values never come back (``EnvField``). Signal mode is not elastic: its DP bounds are dp's.
    """

    name = forms.RegexField(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", max_length=128,
                            help_text="Letters, digits, ., _ and -.",
                            error_messages={"invalid": "Letters, digits, ., _ and - only (first a letter or digit)."})
    priority = forms.ChoiceField(label="Class", choices=Priority.choices, initial=Priority.REGULAR)
    entrypoint = forms.CharField(
        max_length=job_actions.ENTRYPOINT_MAX_ARGS * (job_actions.ARG_MAX_CHARS + 3), strip=False,
        initial=shlex.join(REFERENCE_ENTRYPOINT), widget=forms.TextInput(attrs={"spellcheck": "false"}),
        help_text="As in a shell: train.py --lr 3e-4, or -m my_pkg.train. A .py file or -m runs with the node's "
                  "Python.",
    )
    workdir = forms.CharField(required=False, max_length=job_actions.WORKDIR_MAX_CHARS, strip=False,
                              label="Working directory", help_text="An absolute path; empty: the job's run dir.")
    env = EnvField(label="Environment",
                   help_text="One variable a line, NAME=value. Values are never shown back: if the form comes "
                             "back with a problem, type them again.")
    integration = forms.ChoiceField(choices=Integration.choices, initial=Integration.OMNI,
                                    help_text="omni: elastic, checkpoints through Omni's runtime. signal: any "
                                              "script, SIGTERM then SIGKILL after the grace; not elastic.")
    grace_s = forms.FloatField(required=False, min_value=0.001, max_value=job_actions.GRACE_S_MAX, initial=30,
                               label="Grace (s)", help_text="Signal mode: seconds from SIGTERM to SIGKILL.")
    max_restarts = forms.IntegerField(min_value=0, max_value=job_actions.MAX_RESTARTS_MAX, initial=0,
                                      label="Restarts after a failure")
    tp = forms.IntegerField(min_value=1, max_value=64, initial=1, label="TP")
    pp = forms.IntegerField(min_value=1, max_value=128, initial=1, label="PP")
    dp = forms.IntegerField(min_value=1, max_value=4096, initial=2, label="DP")
    dp_min = forms.IntegerField(required=False, min_value=1, max_value=4096, label="DP at least",
                                help_text="Empty: dp.")
    dp_max = forms.IntegerField(required=False, min_value=1, max_value=4096, label="DP at most",
                                help_text="Empty: dp.")
    global_batch = forms.IntegerField(min_value=1, initial=64, label="Global batch")
    micro_batch = forms.IntegerField(min_value=1, initial=4, label="Micro-batch")
    total_steps = forms.IntegerField(min_value=1, initial=1000, label="Steps")
    step_s = forms.FloatField(min_value=0.001, max_value=86400, initial=1.0, label="Seconds per step",
                              help_text="Expected; the ETA uses it until steps are measured.")
    checkpoint_every_steps = forms.IntegerField(min_value=1, initial=500, label="Checkpoint every (steps)")

    # The job's shape: what the preview needs to say anything.
    LAYOUT_FIELDS = ("tp", "pp", "dp", "dp_min", "dp_max")

    def __init__(self, *args: Any, user, **kwargs: Any) -> None:
        kwargs.setdefault("auto_id", "submit_%s")  # the dashboard's filters have their own id_priority
        super().__init__(*args, **kwargs)
        # Only the classes this user may submit: critical is operators' (submit_job refuses it).
        if not roles.is_operator(user):
            self.fields["priority"].choices = [(v, label) for v, label in Priority.choices
                                               if v != Priority.CRITICAL]

    def clean_entrypoint(self) -> list[str]:
        try:
            words = shlex.split(self.cleaned_data["entrypoint"])
        except ValueError as exc:  # an unclosed quote
            raise ValidationError(f"not a shell-like line: {exc}") from exc
        if not words:
            raise ValidationError("This field is required.")
        return words

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if data.get("integration") == Integration.SIGNAL:
            data["dp_min"] = data["dp_max"] = None  # not elastic: both bounds are dp
        elif "grace_s" in data:
            data["grace_s"] = None  # only signal mode has a grace
        return data

    def spec(self, data: dict[str, Any] | None = None) -> dict[str, Any]:
        """The keyword arguments of ``submit_job`` (and ``check_submission``) from cleaned data;
        an empty optional field takes the action's default."""
        data = self.cleaned_data if data is None else data
        return {name: value for name, value in data.items() if value is not None}

    def preview_spec(self) -> dict[str, Any]:
        """What the live preview checks while the form is still being filled in: every field
        that parsed, and for the others their initial value, so one unfinished field does not
        hide what the rest would do. The fields that took a default are ``preview_defaulted``."""
        self.is_valid()
        data = dict(self.cleaned_data)
        self.preview_defaulted = set(self.fields) - set(data)
        for name in self.preview_defaulted:
            field = self.fields[name]
            if name == "name":
                data[name] = ""  # no job has it, so the name check says nothing
            elif name == "entrypoint":
                data[name] = list(REFERENCE_ENTRYPOINT)
            elif name == "env":
                data[name] = {}
            elif field.required:
                data[name] = field.initial
            else:
                data[name] = None
        if data.get("integration") == Integration.SIGNAL:
            data["dp_min"] = data["dp_max"] = None
        elif data.get("integration") is not None:
            data["grace_s"] = None
        return self.spec(data)

    def add_action_errors(self, error: ValidationError, skip: set[str] = frozenset()) -> None:
        """Show an action's ValidationError on the fields it names (or on the form)."""
        if not hasattr(error, "error_dict"):
            self.add_error(None, error.messages)
            return
        for name, messages in error.message_dict.items():
            if name in skip:
                continue
            if name in self.fields and name in self.errors:
                continue  # the field's own problem is the one to fix first
            self.add_error(name if name in self.fields else None, messages)
