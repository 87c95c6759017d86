"""Django admin for operators: list filters and search everywhere; nothing is saved around the
actions, so the admin never bypasses the audit log (docs/audit-log.md lists what it may change).

Rows written by the planner, an agent or a state machine are read-only. What an operator may
change (a node's place and GPUs; a job's owner, priority and run guarantee, and a pending job's
spec) is saved by the audited actions ``edit_node`` and ``edit_job``; nodes are registered and
removed by ``register_node`` and ``remove_node``; the bulk actions call the same functions as
the console and the API.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import HttpResponseRedirect
from django.urls import reverse

from jobs import actions
from jobs.actions.jobs import env_names
from jobs.forms import EnvField
from jobs.models import (
    Allocation,
    AllocationSpan,
    ApiToken,
    Command,
    ElasticEvent,
    IllegalTransition,
    Job,
    Node,
    PlannerControl,
    PlannerRun,
    Reservation,
    Team,
    TeamMembership,
)


def _run_action(modeladmin, request, queryset, action, label: str) -> None:
    done = 0
    for obj in queryset:
        try:
            action(obj, request.user)
            done += 1
        except (IllegalTransition, PermissionDenied, ValidationError) as exc:
            said = " ".join(exc.messages) if isinstance(exc, ValidationError) else str(exc)
            modeladmin.message_user(request, f"{obj}: {said}", level=messages.ERROR)
    if done:
        modeladmin.message_user(request, f"{label}: {done} done.")


class ReadOnlyAdmin(admin.ModelAdmin):
    """Browse and search only: these rows change through actions and tasks, which own every write."""

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


class AllocationInline(admin.TabularInline):
    """The GPUs a node or job holds, view-only: only the planner's pass allocates and frees."""

    model = Allocation
    extra = 0
    can_delete = False
    fields = ("job", "node", "gpu_index", "borrowed_from", "loan_until", "since")
    readonly_fields = fields

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


def _add_errors(form: forms.Form, exc: ValidationError) -> None:
    """An action's refusal on the form: on the field when the form shows it, else above the form."""
    if not hasattr(exc, "error_dict"):
        form.add_error(None, exc)
        return
    for field, errors in exc.error_dict.items():
        form.add_error(field if field in form.fields else None, errors)


class ActionForm(forms.ModelForm):
    """A change form checked by its action's own validator (``validate``: the row and the changes
    in, the row as it would become out, or ValidationError) instead of the model's full_clean.
    The action derives fields the form does not hold (a job's accumulation) and is the only thing
    that saves, so the form never builds the instance; the action checks again under its locks."""

    validate: ClassVar[Callable[[Any, dict[str, Any]], Any]]

    def changes(self) -> dict[str, Any]:
        """What the operator changed; for a new row, everything the form holds."""
        if self.instance.pk is None:
            return dict(self.cleaned_data)
        return {name: self.cleaned_data[name] for name in self.changed_data if name in self.cleaned_data}

    def _post_clean(self) -> None:
        try:
            self.validate(self.instance, self.changes())
        except ValidationError as exc:
            _add_errors(self, exc)


class ActionAdmin(admin.ModelAdmin):
    """Saves through the model's actions (``save_through``), never ``obj.save()``. Only the fields
    ``editable_fields(obj)`` names are in the form; a row with none is view-only."""

    form: type[ActionForm]

    def editable_fields(self, obj) -> tuple[str, ...]:
        raise NotImplementedError

    def save_through(self, user, obj, changes: dict[str, Any], change: bool):
        """Call the action that saves ``changes`` and return the row it saved."""
        raise NotImplementedError

    def has_change_permission(self, request, obj=None) -> bool:
        if obj is not None and not self.editable_fields(obj):
            return False
        return super().has_change_permission(request, obj)

    def get_fields(self, request, obj=None) -> list[str]:
        return [f.name for f in self.model._meta.concrete_fields if not f.primary_key]  # in the model's order

    def get_readonly_fields(self, request, obj=None) -> list[str]:
        editable = self.editable_fields(obj)
        return [name for name in self.get_fields(request, obj) if name not in editable]

    def save_model(self, request, obj, form: ActionForm, change: bool) -> None:
        saved = self.save_through(request.user, obj, form.changes(), change)
        # The admin's messages, change log and redirect read ``obj``: show them the saved row.
        for field in saved._meta.concrete_fields:
            setattr(obj, field.attname, getattr(saved, field.attname))
        obj._state.adding = False

    def save_related(self, request, form, formsets, change) -> None:
        """Write nothing more: everything the operator changed went through the action in
        ``save_model``, these models have no many-to-many fields, and the inlines are view-only.
        (A formset saved without commit only lists what changed, for the admin's change message.)"""
        for formset in formsets:
            formset.save(commit=False)

    def changeform_view(self, request, object_id=None, form_url="", extra_context=None):
        try:
            return super().changeform_view(request, object_id, form_url, extra_context)
        except ValidationError as exc:
            # The action checks again under its locks; what changed since the form was checked
            # (a job that started meanwhile) is refused there, rolled back, and said here.
            self.message_user(request, " ".join(exc.messages), level=messages.ERROR)
            return HttpResponseRedirect(request.get_full_path())


class NodeForm(ActionForm):
    validate = staticmethod(actions.node_with_changes)


@admin.register(Node)
class NodeAdmin(ActionAdmin):
    """Register, edit (rack, switch, GPU model and count) and remove nodes, each audited; state,
    heartbeat, speed factor and token are measured or issued elsewhere and only shown."""

    form = NodeForm
    list_display = ("name", "rack", "switch", "gpu_count", "gpu_model", "state", "speed_factor", "last_heartbeat_at")
    list_filter = ("state", "rack", "switch", "gpu_model")
    search_fields = ("name", "rack", "switch")
    inlines = [AllocationInline]
    actions = ["cordon", "uncordon", "drain", "repair"]

    def editable_fields(self, obj) -> tuple[str, ...]:
        return actions.NODE_EDITABLE if obj is not None else ("name", *actions.NODE_EDITABLE)

    def save_through(self, user, obj, changes: dict[str, Any], change: bool) -> Node:
        return actions.edit_node(obj, user, **changes) if change else actions.register_node(user, **changes)

    def get_actions(self, request):
        # Nodes are deleted one at a time, so a refusal says which node and why.
        found = super().get_actions(request)
        found.pop("delete_selected", None)
        return found

    def delete_view(self, request, object_id, extra_context=None):
        node = self.get_object(request, unquote(object_id))
        refusal = actions.node_removal_refusal(node) if node is not None else ""
        if refusal:
            self.message_user(request, refusal, level=messages.ERROR)
            return HttpResponseRedirect(reverse("admin:jobs_node_change", args=[node.pk]))
        try:
            return super().delete_view(request, object_id, extra_context)
        except ValidationError as exc:  # history written since the check above
            self.message_user(request, " ".join(exc.messages), level=messages.ERROR)
            return HttpResponseRedirect(reverse("admin:jobs_node_change", args=[node.pk]))

    def delete_model(self, request, obj: Node) -> None:
        actions.remove_node(obj, request.user)

    def delete_queryset(self, request, queryset) -> None:
        for node in queryset:
            actions.remove_node(node, request.user)

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


class JobForm(ActionForm):
    validate = staticmethod(actions.job_with_changes)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if "env" in self.fields:  # names shown, values kept unless replaced, never rendered
            self.fields["env"] = EnvField(current=self.instance.env, label="Env")


@admin.register(Job)
class JobAdmin(ActionAdmin):
    """Edit a job's owner, priority, run guarantee and restarts until it ends, and its spec and
    workload while it is pending, each audited. Jobs are submitted by their owner through the API
    or dashboard (the submit row is theirs), never added here, and never deleted: cancel them.
    The environment's values are never shown, editable or not."""

    form = JobForm
    list_display = (
        "name", "owner", "priority", "state", "integration", "tp", "pp", "dp", "accum_steps", "global_batch",
        "committed_steps", "total_steps", "submitted_at",
    )
    list_filter = ("state", "priority", "integration", "owner")
    search_fields = ("name", "owner__username")
    list_select_related = ("owner",)
    inlines = [AllocationInline]
    actions = ["cancel"]

    def editable_fields(self, obj) -> tuple[str, ...]:
        return actions.job_editable_fields(obj) if obj is not None else ()

    def get_fields(self, request, obj=None) -> list[str]:
        fields = super().get_fields(request, obj)
        if "env" in self.editable_fields(obj):
            return fields
        return ["env_names" if name == "env" else name for name in fields]

    @admin.display(description="Env")
    def env_names(self, job: Job) -> str:
        return ", ".join(env_names(job.env)) or "-"

    def save_through(self, user, obj, changes: dict[str, Any], change: bool) -> Job:
        return actions.edit_job(obj, user, **changes)

    def has_add_permission(self, request) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    @admin.action(description="Cancel the selected jobs")
    def cancel(self, request, queryset):
        _run_action(self, request, queryset, actions.cancel_job, "Cancelled")


class TokenStateFilter(admin.SimpleListFilter):
    """API tokens live (authenticating) or revoked."""

    title = "state"
    parameter_name = "state"

    def lookups(self, request, model_admin) -> list[tuple[str, str]]:
        return [("live", "Live"), ("revoked", "Revoked")]

    def queryset(self, request, queryset):
        if self.value() in ("live", "revoked"):
            return queryset.filter(revoked_at__isnull=self.value() == "live")
        return queryset


@admin.register(ApiToken)
class ApiTokenAdmin(ReadOnlyAdmin):
    """Who holds which API token, by its prefix (the token itself is never stored), when each was
    last used, and a bulk action that revokes the selected ones through the audited
    ``revoke_api_token`` (``manage.py revoke_api_token`` and ``DELETE /api/token/`` do the same).
    Tokens are issued by ``manage.py issue_api_token`` or ``POST /api/token/``, never added here."""

    list_display = ("user", "prefix", "label", "created_at", "last_used_at", "revoked_at")
    list_filter = (TokenStateFilter,)
    search_fields = ("user__username", "prefix", "label")
    list_select_related = ("user",)
    actions = ["revoke"]

    @admin.action(description="Revoke the selected API tokens")
    def revoke(self, request, queryset):
        _run_action(self, request, queryset, lambda row, user: actions.revoke_api_token(user, row), "Revoked")


@admin.register(Reservation)
class ReservationAdmin(ReadOnlyAdmin):
    # Created and edited through jobs.actions (validated and audited): the console and API.
    list_display = ("name", "job", "team", "gpus", "spares", "start_at", "end_at", "period_s", "active_s", "cancelled_at")
    list_filter = ("team",)
    search_fields = ("name", "job__name", "team__name")
    list_select_related = ("job", "team")


@admin.register(Team)
class TeamAdmin(ReadOnlyAdmin):
    # Created, edited and deleted through jobs.actions.teams (validated and audited): the API.
    list_display = ("name", "parent", "quota_gpus", "borrow_limit_gpus", "weight", "created_at")
    search_fields = ("name",)
    list_select_related = ("parent",)


@admin.register(TeamMembership)
class TeamMembershipAdmin(ReadOnlyAdmin):
    # Changed through jobs.actions.teams (audited): the API.
    list_display = ("team", "user", "is_default", "created_at")
    list_filter = ("team",)
    search_fields = ("team__name", "user__username")
    list_select_related = ("team", "user")


@admin.register(Allocation)
class AllocationAdmin(ReadOnlyAdmin):
    list_display = ("node", "gpu_index", "job", "borrowed_from", "loan_until", "since")
    list_filter = ("node__rack", "borrowed_from")
    search_fields = ("node__name", "job__name")
    list_select_related = ("node", "job", "borrowed_from")


@admin.register(AllocationSpan)
class AllocationSpanAdmin(ReadOnlyAdmin):
    # The allocation history: written with each Allocation row, never edited.
    list_display = ("node", "gpu_index", "job", "borrowed_from", "started_at", "ended_at")
    list_filter = ("node__rack",)
    search_fields = ("node__name", "job__name")
    list_select_related = ("node", "job", "borrowed_from")
    date_hierarchy = "started_at"


@admin.register(Command)
class CommandAdmin(ReadOnlyAdmin):
    # The outbox's delivery state machine moves as agents answer; a re-save would race it.
    list_display = ("id", "kind", "job", "node", "state", "attempts", "created_at", "acked_at", "finished_at")
    list_filter = ("state", "kind")
    search_fields = ("id", "job__name", "node__name")
    list_select_related = ("job", "node")
    readonly_fields = [f.name for f in Command._meta.fields]


@admin.register(ElasticEvent)
class ElasticEventAdmin(ReadOnlyAdmin):
    list_display = ("id", "at", "kind", "job_name", "actor", "dp_before", "dp_after", "gpus_before", "gpus_after")
    list_filter = ("kind", "actor")
    search_fields = ("job_name", "actor", "planner_run")
    date_hierarchy = "at"
    readonly_fields = [f.name for f in ElasticEvent._meta.fields]


@admin.register(PlannerRun)
class PlannerRunAdmin(ReadOnlyAdmin):
    # Audit rows name their pass by id; deleting a run would orphan them.
    list_display = ("id", "started_at", "duration_ms", "actions", "applied", "dry_run", "trigger", "error")
    list_filter = ("applied", "dry_run")
    readonly_fields = [f.name for f in PlannerRun._meta.fields]


@admin.register(PlannerControl)
class PlannerControlAdmin(ReadOnlyAdmin):
    # Changed through jobs.actions.set_planner_control (audited): the console and API.
    list_display = ("__str__", "paused", "dry_run", "safety_factor", "min_run_s", "reclaim_grace_s", "updated_by")
