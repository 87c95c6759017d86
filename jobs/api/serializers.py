"""Serializers for the jobs API: reads are complete, writes validate every field and refuse
any field they do not take (``StrictFields``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from drf_spectacular.extensions import OpenApiSerializerExtension
from rest_framework import serializers

from jobs import roles
from jobs.actions import jobs as job_actions
from jobs.live_data import rhythm_summary
from jobs.models import Allocation, ElasticEvent, Integration, Job, Node, Priority, Reservation, Team

UNKNOWN_FIELD = "Unknown field."
READ_ONLY_FIELD = "This field is read-only."
# How a job's environment is shown back, to its owner too: the names, never a value.
MASKED_VALUE = "***"


class StrictFields:
    """A write serializer that answers 400 for every field it does not take, a read-only one
    included (``{"comand": ["Unknown field."]}``), instead of dropping it: a misspelt field must
    not turn into a job that runs something else. The same shape as every other field error
    (jobs/api/errors.py), reported with them."""

    def refused_fields(self, data: Any) -> dict[str, list[str]]:
        if not isinstance(data, Mapping):
            return {}  # the serializer's own "expected a dictionary" says it
        fields = self.fields
        return {
            name: [READ_ONLY_FIELD if name in fields else UNKNOWN_FIELD]
            for name in data
            if name not in fields or fields[name].read_only
        }

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        refused = self.refused_fields(data)
        try:
            value = super().to_internal_value(data)
        except serializers.ValidationError as exc:
            if refused and isinstance(exc.detail, dict):
                raise serializers.ValidationError({**exc.detail, **refused}) from None
            raise
        if refused:
            raise serializers.ValidationError(refused)
        return value


class StringField(serializers.CharField):
    """A CharField that takes only strings: DRF's turns ``1`` into ``"1"``, and an argv word or an
    environment value that was a number in the request is a mistake to say, not to guess."""

    default_error_messages = {"not_a_string": "Not a string."}

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("not_a_string")
        return super().to_internal_value(data)


class NoBodySerializer(StrictFields, serializers.Serializer):
    """The body of an action that takes none (cancel, cordon, drain, ...): any field is unknown."""


class AllocationSerializer(serializers.ModelSerializer):
    node = serializers.CharField(source="node.name")
    borrowed_from = serializers.CharField(source="borrowed_from.name", default=None, allow_null=True, read_only=True,
                                          help_text="The reservation this GPU is only lent from; null: not a loan.")

    class Meta:
        model = Allocation
        fields = ["node", "gpu_index", "borrowed_from", "loan_until", "since"]


class JobSerializer(serializers.ModelSerializer):
    """A job in full, or its summary (``roles.summarise``) for a viewer who may see only that."""

    owner = serializers.CharField(source="owner.username", read_only=True)
    team = serializers.CharField(source="team.name", default=None, allow_null=True, read_only=True,
                                 help_text="The team whose quota it runs under (docs/teams.md); null: none.")
    gpus = serializers.SerializerMethodField()
    allocations = AllocationSerializer(many=True, read_only=True)
    env = serializers.SerializerMethodField(help_text=f"The extra environment's names; every value reads {MASKED_VALUE!r}.")
    rhythm = serializers.SerializerMethodField(
        help_text="What was measured about its steps (docs/rhythm.md): step time, prediction error, idle phases, "
                  "where the time goes, stragglers; null before the first step record.")

    class Meta:
        model = Job
        fields = [
            "id", "name", "owner", "team", "priority", "state", "tp", "pp", "dp", "dp_min", "dp_max",
            "global_batch", "micro_batch", "accum_steps", "total_steps", "committed_steps", "step_s",
            "comm_fraction", "min_run_s", "checkpoint_every_steps", "checkpoint_save_s", "checkpoint_load_s",
            "last_checkpoint_step", "last_checkpoint_at", "measured_save_s", "measured_load_s",
            "preemptions", "pending_reason", "pending_since", "submitted_at", "started_at", "finished_at", "gpus", "allocations",
            "entrypoint", "workdir", "env", "integration", "grace_s", "max_restarts", "restarts", "keep_checkpoints",
            "run_id", "failure", "rhythm",
        ]
        read_only_fields = fields

    def get_gpus(self, job: Job) -> int:
        return len(job.allocations.all())

    def get_env(self, job: Job) -> dict[str, str]:
        return dict.fromkeys(job_actions.env_names(job.env), MASKED_VALUE)

    def get_rhythm(self, job: Job) -> dict | None:
        return rhythm_summary(job)

    def to_representation(self, job: Job) -> dict:
        data = super().to_representation(job)
        request = self.context.get("request")
        if request is not None and roles.job_visibility(request.user, job) is not roles.Visibility.FULL:
            return roles.summarise(data)
        return {**data, "visibility": "full"}


class JobSchema(OpenApiSerializerExtension):
    """A job reads in full or as its summary (``roles.summarise``), so the schema requires only
    the summary's fields, and says ``visibility``: a full record's other fields are present then."""

    target_class = JobSerializer

    def map_serializer(self, auto_schema, direction):
        schema = auto_schema._map_serializer(self.target, direction, bypass_extensions=True)
        schema["properties"]["visibility"] = {
            "type": "string", "enum": ["full", "summary"], "readOnly": True,
            "description": "full: every field; summary: only id, name, owner, priority, state, gpus and the like.",
        }
        schema["required"] = [name for name in schema.get("required", []) if name in roles.SUMMARY_FIELDS]
        schema["required"].append("visibility")
        return schema


class JobSubmitSerializer(StrictFields, serializers.Serializer):
    """What a researcher sends to submit a job (docs/workloads.md): each field's type and range.
    The rules on what a field holds (the environment's names, an absolute workdir) and across
    fields and against the cluster (batch split, DP bounds, a signal-mode job not elastic, fits
    the nodes) are ``submit_job``'s, which answers a ValidationError per field: the API's 400, the
    same as the admin's and the action's."""

    name = serializers.RegexField(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", max_length=128)
    priority = serializers.ChoiceField(choices=Priority.choices, default=Priority.REGULAR)
    team = serializers.SlugRelatedField(
        slug_field="name", queryset=Team.objects.all(), required=False, allow_null=True,
        help_text="The team it runs under: omitted, the submitter's default team; null, none (it only borrows). "
                  "Researchers: a team they are in.",
    )
    tp = serializers.IntegerField(min_value=1, max_value=64, default=1)
    pp = serializers.IntegerField(min_value=1, max_value=128, default=1)
    dp = serializers.IntegerField(min_value=1, max_value=4096)
    dp_min = serializers.IntegerField(min_value=1, max_value=4096, required=False)
    dp_max = serializers.IntegerField(min_value=1, max_value=4096, required=False)
    global_batch = serializers.IntegerField(min_value=1)
    micro_batch = serializers.IntegerField(min_value=1)
    total_steps = serializers.IntegerField(min_value=1)
    step_s = serializers.FloatField(min_value=0.001, max_value=86400)
    comm_fraction = serializers.FloatField(min_value=0.0, max_value=1.0, default=0.1)
    min_run_s = serializers.IntegerField(min_value=0, required=False)
    checkpoint_every_steps = serializers.IntegerField(min_value=1, default=500)
    checkpoint_save_s = serializers.FloatField(min_value=0.0, default=30.0)
    checkpoint_load_s = serializers.FloatField(min_value=0.0, default=60.0)
    # The workload: what runs on the job's GPUs.
    entrypoint = serializers.ListField(
        child=StringField(max_length=job_actions.ARG_MAX_CHARS, trim_whitespace=False),
        min_length=1, max_length=job_actions.ENTRYPOINT_MAX_ARGS, required=False,
        help_text="argv, e.g. [\"train.py\", \"--lr\", \"3e-4\"]: a first word ending in .py, or -m MODULE, runs "
        "with the node's Python; anything else is an executable. Default: the reference trainer.",
    )
    workdir = serializers.CharField(
        max_length=job_actions.WORKDIR_MAX_CHARS, allow_blank=True, trim_whitespace=False, default="",
        help_text="The ranks' working directory; empty: the job's run dir.",
    )
    env = serializers.DictField(
        child=StringField(max_length=job_actions.ARG_MAX_CHARS, allow_blank=True, trim_whitespace=False),
        required=False,
        help_text="Extra environment of the ranks; never shown back. Not OMNI_*, TORCHELASTIC_* or torchrun's own.",
    )
    integration = serializers.ChoiceField(choices=Integration.choices, default=Integration.OMNI)
    grace_s = serializers.FloatField(min_value=0.0, max_value=job_actions.GRACE_S_MAX, default=30.0,
                                     help_text="Signal mode: seconds from SIGTERM to SIGKILL (more than 0).")
    max_restarts = serializers.IntegerField(min_value=0, max_value=job_actions.MAX_RESTARTS_MAX, default=0)
    keep_checkpoints = serializers.IntegerField(min_value=1, max_value=job_actions.KEEP_CHECKPOINTS_MAX, default=3)


class NodeSerializer(serializers.ModelSerializer):
    gpus_allocated = serializers.SerializerMethodField()

    class Meta:
        model = Node
        fields = [
            "id", "name", "rack", "switch", "gpu_count", "gpu_model", "state", "state_changed_at",
            "last_heartbeat_at", "speed_factor", "gpus_allocated",
        ]
        read_only_fields = fields

    def get_gpus_allocated(self, node: Node) -> int:
        return len(node.allocations.all())


class NodeRegisterSerializer(StrictFields, serializers.Serializer):
    """What an operator sends to register a node (``register_node`` checks the rest: a unique
    name, at least one GPU)."""

    name = serializers.CharField(max_length=64)
    rack = serializers.CharField(max_length=64)
    switch = serializers.CharField(max_length=64)
    gpu_count = serializers.IntegerField(min_value=1, max_value=32767)
    gpu_model = serializers.CharField(max_length=64, default="H100-80GB")


class ReservationSerializer(StrictFields, serializers.ModelSerializer):
    """A reservation for one critical job (``job``) or for a team's critical jobs (``team``)."""

    job = serializers.SlugRelatedField(slug_field="name", queryset=Job.objects.all(), required=False, allow_null=True)
    team = serializers.SlugRelatedField(
        slug_field="name", queryset=Team.objects.all(), required=False, allow_null=True,
        help_text="A team's reservation: its GPUs go to whichever of the team's critical jobs runs, and it outlives "
                  "them. On an edit, hands a job's reservation to its team.",
    )

    class Meta:
        model = Reservation
        fields = [
            "id", "name", "job", "team", "gpus", "spares", "start_at", "end_at", "period_s", "active_s",
            "created_at", "cancelled_at",
        ]
        read_only_fields = ["id", "created_at", "cancelled_at"]
        # Uniqueness is checked by the action, with a clearer message.
        extra_kwargs = {"name": {"validators": []}, "gpus": {"min_value": 1}, "period_s": {"min_value": 1},
                        "active_s": {"min_value": 1}}

    def to_representation(self, reservation: Reservation) -> dict:
        data = super().to_representation(reservation)
        request = self.context.get("request")
        if (request is not None and reservation.job_id is not None
                and roles.job_visibility(request.user, reservation.job) is roles.Visibility.NONE):
            data["job"] = None  # a job the viewer may not know of (OMNI_JOB_VISIBILITY=own)
        return data


# -- teams (docs/teams.md) ---------------------------------------------------------------------------


class TeamWriteSerializer(StrictFields, serializers.Serializer):
    """What an operator sends to create (``name`` required) or edit a team (``name`` fixed); the
    rules (a cycle of parents, a taken name) are ``jobs.actions.teams``'."""

    name = serializers.CharField(max_length=64)
    parent = serializers.SlugRelatedField(slug_field="name", queryset=Team.objects.all(), required=False,
                                          allow_null=True, help_text="The enclosing team (organisation); null: none.")
    quota_gpus = serializers.IntegerField(min_value=0, required=False)
    borrow_limit_gpus = serializers.IntegerField(min_value=0, required=False, allow_null=True,
                                                 help_text="GPUs it may borrow beyond its quota; null: no limit.")
    weight = serializers.FloatField(min_value=0.001, max_value=1000, required=False)


class TeamMemberWriteSerializer(StrictFields, serializers.Serializer):
    """Add a member: the user's name, and whether this becomes their default team."""

    user = serializers.CharField(max_length=150)
    default = serializers.BooleanField(default=False)


class TeamMemberSerializer(serializers.Serializer):
    """A member as the members endpoints answer (``team_data.team_detail``'s ``members``)."""

    user = serializers.CharField()
    default = serializers.BooleanField()
    since = serializers.DateTimeField()


class TeamBarSerializer(serializers.Serializer):
    """Where a team's bar is filled (``team_data.team_bar``), in percent of its track."""

    within_pct = serializers.FloatField()
    borrowed_pct = serializers.FloatField()
    quota_pct = serializers.FloatField()
    scale_gpus = serializers.IntegerField()


class TeamStandingSerializer(serializers.Serializer):
    """A team as the list answers it (``team_data.team_standings``): its settings and the GPUs it
    (its teams included) holds now. For the schema only: the rows are built in one pass."""

    id = serializers.IntegerField()
    name = serializers.CharField()
    parent = serializers.CharField(allow_null=True)
    quota_gpus = serializers.IntegerField()
    borrow_limit_gpus = serializers.IntegerField(allow_null=True, help_text="null: no limit.")
    weight = serializers.FloatField()
    members_count = serializers.IntegerField(allow_null=True)
    gpus_held = serializers.IntegerField(help_text="GPUs its jobs (and its teams') hold against its quota.")
    gpus_on_loan = serializers.IntegerField(
        help_text="Beside gpus_held: GPUs other teams' reservations lend its jobs, counted against no quota.")
    gpus_borrowed = serializers.IntegerField(help_text="GPUs held beyond the quota.")
    gpus_may_take = serializers.IntegerField(allow_null=True, help_text="What it may still take, quota and "
                                             "borrowing together; null: no limit.")
    words = serializers.CharField(help_text="The standing in a sentence, as the team page says it.")
    bar = TeamBarSerializer()
    default = serializers.BooleanField(required=False, help_text="With `?mine=1` only: whether my submits go "
                                       "to this team when they name none.")


class TeamJobSerializer(serializers.Serializer):
    """One of a team's unfinished jobs, in full or as a summary (``visibility``) as the viewer may see it."""

    id = serializers.IntegerField()
    name = serializers.CharField()
    owner = serializers.CharField()
    priority = serializers.CharField()
    priority_label = serializers.CharField()
    state = serializers.CharField()
    state_label = serializers.CharField()
    gpus = serializers.IntegerField()
    borrowed_gpus = serializers.IntegerField()
    visibility = serializers.ChoiceField(choices=["full", "summary"])
    team = serializers.CharField(required=False, help_text="In full only.")
    gpus_wanted = serializers.IntegerField(required=False, help_text="In full only.")
    pending_reason = serializers.CharField(required=False, allow_blank=True, help_text="In full only.")


class TeamReservationSerializer(serializers.Serializer):
    """A live reservation of the team's or of one of its jobs."""

    id = serializers.IntegerField()
    name = serializers.CharField()
    team = serializers.CharField(allow_null=True)
    job = serializers.CharField(allow_null=True)
    gpus = serializers.IntegerField()
    spares = serializers.IntegerField()
    start_at = serializers.DateTimeField()
    end_at = serializers.DateTimeField(allow_null=True)
    period_s = serializers.IntegerField(allow_null=True)
    active_s = serializers.IntegerField(allow_null=True)
    active_now = serializers.BooleanField()


class TeamDetailSerializer(TeamStandingSerializer):
    """A team's detail (``team_data.team_detail``): its standing, members, jobs and reservations."""

    members = TeamMemberSerializer(many=True)
    jobs = TeamJobSerializer(many=True)
    reservations = TeamReservationSerializer(many=True)


class ElasticEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = ElasticEvent
        fields = [
            "id", "at", "kind", "job", "job_name", "nodes_before", "nodes_after", "gpus_before", "gpus_after",
            "dp_before", "dp_after", "accum_before", "accum_after", "global_batch", "actor", "planner_run",
            "command", "refers_to", "reason", "outcome", "prev_hash", "hash",
        ]
        read_only_fields = fields
