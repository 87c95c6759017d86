"""Django admin for operators: list filters and search everywhere; the audit log is read-only.

Writes that other surfaces make through jobs.actions go through the same actions here (the
admin actions below), so the admin never bypasses the audit log.
"""

from __future__ import annotations

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied, ValidationError

from jobs import actions
from jobs.models import (
    Allocation,
    Command,
    ElasticEvent,
    IllegalTransition,
    Job,
    Node,
    PlannerControl,
    PlannerRun,
    Reservation,
)


def _run_action(modeladmin, request, queryset, action, label: str) -> None:
    done = 0
    for obj in queryset:
        try:
            action(obj, request.user)
            done += 1
        except (IllegalTransition, PermissionDenied, ValidationError) as exc:
            modeladmin.message_user(request, f"{obj}: {exc}", level=messages.ERROR)
    if done:
        modeladmin.message_user(request, f"{label}: {done} done.")


class ReadOnlyAdmin(admin.ModelAdmin):
    """Browse and search only: these rows change through jobs.actions, which audits every write."""

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


class AllocationInline(admin.TabularInline):
    model = Allocation
    extra = 0
    can_delete = False
    fields = ("job", "node", "gpu_index", "borrowed_from", "loan_until", "since")
    readonly_fields = fields

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ("name", "rack", "switch", "gpu_count", "gpu_model", "state", "speed_factor", "last_heartbeat_at")
    list_filter = ("state", "rack", "switch", "gpu_model")
    search_fields = ("name", "rack", "switch")
    readonly_fields = ("state", "state_changed_at", "last_heartbeat_at", "agent_token_hash", "created_at")
    inlines = [AllocationInline]
    actions = ["cordon", "uncordon", "drain", "repair"]

    @admin.action(description="Cordon: place nothing new")
    def cordon(self, request, queryset):
        _run_action(self, request, queryset, actions.cordon_node, "Cordoned")

    @admin.action(description="Uncordon: return to service")
    def uncordon(self, request, queryset):
        _run_action(self, request, queryset, actions.uncordon_node, "Uncordoned")

    @admin.action(description="Drain: move work off gracefully")
    def drain(self, request, queryset):
        _run_action(self, request, queryset, actions.drain_node, "Draining")

    @admin.action(description="Mark repaired (healthy)")
    def repair(self, request, queryset):
        _run_action(self, request, queryset, actions.mark_node_repaired, "Marked repaired")


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = (
        "name", "owner", "priority", "state", "tp", "pp", "dp", "accum_steps", "global_batch",
        "committed_steps", "total_steps", "submitted_at",
    )
    list_filter = ("state", "priority", "owner")
    search_fields = ("name", "owner__username")
    list_select_related = ("owner",)
    readonly_fields = (
        "state", "dp", "accum_steps", "committed_steps", "last_checkpoint_step", "last_checkpoint_at",
        "measured_save_s", "measured_load_s", "preemptions", "pending_reason", "submitted_at", "started_at",
        "first_started_at", "last_resized_at", "finished_at", "state_changed_at",
    )
    inlines = [AllocationInline]
    actions = ["cancel"]

    def has_add_permission(self, request) -> bool:
        return False  # submit through the API or dashboard so the audit log records it

    @admin.action(description="Cancel the selected jobs")
    def cancel(self, request, queryset):
        _run_action(self, request, queryset, actions.cancel_job, "Cancelled")


@admin.register(Reservation)
class ReservationAdmin(ReadOnlyAdmin):
    # Created and edited through jobs.actions (validated and audited): the console and API.
    list_display = ("name", "job", "gpus", "spares", "start_at", "end_at", "period_s", "active_s", "cancelled_at")
    list_filter = ("job",)
    search_fields = ("name", "job__name")
    list_select_related = ("job",)


@admin.register(Allocation)
class AllocationAdmin(ReadOnlyAdmin):
    list_display = ("node", "gpu_index", "job", "borrowed_from", "loan_until", "since")
    list_filter = ("node__rack", "borrowed_from")
    search_fields = ("node__name", "job__name")
    list_select_related = ("node", "job", "borrowed_from")


@admin.register(Command)
class CommandAdmin(admin.ModelAdmin):
    list_display = ("id", "kind", "job", "node", "state", "attempts", "created_at", "acked_at", "finished_at")
    list_filter = ("state", "kind")
    search_fields = ("id", "job__name", "node__name")
    list_select_related = ("job", "node")
    readonly_fields = [f.name for f in Command._meta.fields]

    def has_add_permission(self, request) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


@admin.register(ElasticEvent)
class ElasticEventAdmin(ReadOnlyAdmin):
    list_display = ("id", "at", "kind", "job_name", "actor", "dp_before", "dp_after", "gpus_before", "gpus_after")
    list_filter = ("kind", "actor")
    search_fields = ("job_name", "actor", "planner_run")
    date_hierarchy = "at"
    readonly_fields = [f.name for f in ElasticEvent._meta.fields]


@admin.register(PlannerRun)
class PlannerRunAdmin(admin.ModelAdmin):
    list_display = ("id", "started_at", "duration_ms", "actions", "applied", "dry_run", "trigger", "error")
    list_filter = ("applied", "dry_run")
    readonly_fields = [f.name for f in PlannerRun._meta.fields]

    def has_add_permission(self, request) -> bool:
        return False


@admin.register(PlannerControl)
class PlannerControlAdmin(admin.ModelAdmin):
    list_display = ("__str__", "paused", "dry_run", "safety_factor", "min_run_s", "reclaim_grace_s", "updated_by")

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False  # changed through jobs.actions.set_planner_control (audited)
