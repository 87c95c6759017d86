"""Serializers for the jobs API: reads are complete, writes validate every field."""

from __future__ import annotations

from rest_framework import serializers

from jobs import roles
from jobs.models import Allocation, ElasticEvent, Job, Node, Priority, Reservation


class AllocationSerializer(serializers.ModelSerializer):
    node = serializers.CharField(source="node.name")
    borrowed_from = serializers.CharField(source="borrowed_from.name", default=None)

    class Meta:
        model = Allocation
        fields = ["node", "gpu_index", "borrowed_from", "loan_until", "since"]


class JobSerializer(serializers.ModelSerializer):
    """A job in full, or its summary (``roles.summarise``) for a viewer who may see only that."""

    owner = serializers.CharField(source="owner.username", read_only=True)
    gpus = serializers.SerializerMethodField()
    allocations = AllocationSerializer(many=True, read_only=True)

    class Meta:
        model = Job
        fields = [
            "id", "name", "owner", "priority", "state", "tp", "pp", "dp", "dp_min", "dp_max",
            "global_batch", "micro_batch", "accum_steps", "total_steps", "committed_steps", "step_s",
            "comm_fraction", "min_run_s", "checkpoint_every_steps", "checkpoint_save_s", "checkpoint_load_s",
            "last_checkpoint_step", "last_checkpoint_at", "measured_save_s", "measured_load_s",
            "preemptions", "pending_reason", "pending_since", "submitted_at", "started_at", "finished_at", "gpus", "allocations",
        ]
        read_only_fields = fields

    def get_gpus(self, job: Job) -> int:
        return len(job.allocations.all())

    def to_representation(self, job: Job) -> dict:
        data = super().to_representation(job)
        request = self.context.get("request")
        if request is not None and roles.job_visibility(request.user, job) is not roles.Visibility.FULL:
            return roles.summarise(data)
        return {**data, "visibility": "full"}


class JobSubmitSerializer(serializers.Serializer):
    """What a researcher sends to submit a job: each field's type and range. The rules across
    fields and against the cluster (batch split, DP bounds, fits the nodes) are ``submit_job``'s,
    which answers a ValidationError per field: the API's 400, the same as the action's."""

    name = serializers.RegexField(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", max_length=128)
    priority = serializers.ChoiceField(choices=Priority.choices, default=Priority.REGULAR)
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


class ReservationSerializer(serializers.ModelSerializer):
    job = serializers.SlugRelatedField(slug_field="name", queryset=Job.objects.all())

    class Meta:
        model = Reservation
        fields = [
            "id", "name", "job", "gpus", "spares", "start_at", "end_at", "period_s", "active_s",
            "created_at", "cancelled_at",
        ]
        read_only_fields = ["id", "created_at", "cancelled_at"]
        # Uniqueness is checked by the action, with a clearer message.
        extra_kwargs = {"name": {"validators": []}, "gpus": {"min_value": 1}, "period_s": {"min_value": 1},
                        "active_s": {"min_value": 1}}

    def to_representation(self, reservation: Reservation) -> dict:
        data = super().to_representation(reservation)
        request = self.context.get("request")
        if request is not None and roles.job_visibility(request.user, reservation.job) is roles.Visibility.NONE:
            data["job"] = None  # a job the viewer may not know of (OMNI_JOB_VISIBILITY=own)
        return data


class ElasticEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = ElasticEvent
        fields = [
            "id", "at", "kind", "job", "job_name", "nodes_before", "nodes_after", "gpus_before", "gpus_after",
            "dp_before", "dp_after", "accum_before", "accum_after", "global_batch", "actor", "planner_run",
            "command", "refers_to", "reason", "outcome", "prev_hash", "hash",
        ]
        read_only_fields = fields
