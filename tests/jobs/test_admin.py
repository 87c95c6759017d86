"""The admin is an operator's browser: it lists and searches, and saves only through the audited
actions. One test walks every registered model, so a field made editable, or a model registered,
without an audited path fails it."""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable
from typing import Any

import pytest
from django import forms
from django.contrib import admin
from django.contrib.auth.models import Group, User
from django.core.exceptions import ValidationError
from django.db import models
from django.urls import reverse
from django.utils import timezone

from jobs import actions
from jobs.actions import describe_changes
from jobs.admin import JobForm
from jobs.forms import EnvField
from jobs.models import ElasticEvent, Job, JobState, Node, NodeState, Priority
from telemetry import rollups
from telemetry.ingest import ingest_gpu_batch
from tests.telemetry.conftest import gpu_batch

pytestmark = pytest.mark.django_db

# Accounts and roles are Django's own admin: recorded in its admin history, not in the cluster's
# audit log (docs/audit-log.md, "What the admin may change").
OUTSIDE_THE_AUDIT_LOG = {User, Group}
# What the walk registers for each model whose admin may add rows.
ADD_EXAMPLES: dict[type[models.Model], dict[str, Any]] = {
    Node: {"name": "r9s0n0", "rack": "r9", "switch": "r9s0", "gpu_count": 8, "gpu_model": "H200-141GB"},
}
PLACED = {"rule": "test", "text": "placed by the test", "inputs": {}}
# The walk's first job carries a secret in its environment, which no page may show.
SECRET = "wandb-secret-value-0123456789"
# Edits valid only with another field changed too: a signal-mode job is not elastic.
ALONG_WITH: dict[str, Callable[[Any], dict[str, Any]]] = {
    "integration": lambda job: {"dp_min": job.dp, "dp_max": job.dp},
}
# Fields whose any other value is not a valid one.
SAMPLE_EDITS: dict[str, Callable[[Any], Any]] = {
    "workdir": lambda current: f"{current or '/srv'}/edited",
}


@pytest.fixture
def admin_client_logged_in(client, django_user_model):
    client.force_login(django_user_model.objects.create_superuser("root", "root@example.org", "root-pass-1234"))
    return client


@pytest.fixture
def cluster(make_nodes, make_job, operator, other_researcher):
    """A row of every model the admin shows, each made by the action or task that makes it."""
    nodes = make_nodes()
    make_job(env={"WANDB_API_KEY": SECRET})  # job-0, pending: the first job, whose whole spec is editable
    actions.place_job(make_job(), [(nodes[0], 0), (nodes[0], 1)], actor="planner", reason=PLACED)
    stopped = actions.place_job(make_job(), [(nodes[1], 0), (nodes[1], 1)], actor="planner", reason=PLACED)
    actions.cancel_job(stopped, operator)  # stop commands
    critical = make_job(owner=operator, priority=Priority.CRITICAL, dp=1, dp_min=1, dp_max=1, global_batch=8,
                        micro_batch=8)
    actions.create_reservation(operator, name="critical-window", job=critical, gpus=2, start_at=timezone.now())
    team = actions.create_team(operator, name="vision", quota_gpus=4)
    actions.add_team_member(team, operator, other_researcher)
    actions.issue_api_token(operator, other_researcher, label="laptop")
    actions.set_planner_control(operator, paused=True)
    actions.run_planner_pass("test")  # a run that applies nothing: the planner is paused
    ingest_gpu_batch(nodes[0], gpu_batch(samples=16, start_s=time.time() - 300))
    rollups.roll_up()  # watermarks
    return nodes


def _url(model, view: str, *args) -> str:
    return reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_{view}", args=args)


def _posted(page, **changes: Any) -> dict[str, Any]:
    """What the page's forms (and inline formsets) send back untouched, with ``changes`` made."""
    shown = [page.context["adminform"].form]
    for inline in page.context["inline_admin_formsets"]:
        shown += [inline.formset.management_form, *inline.formset.forms]
    data: dict[str, Any] = {}
    for form in shown:
        for bound in form:
            value = bound.value()
            if isinstance(bound.field, forms.BooleanField):
                if value:
                    data[bound.html_name] = "on"
                continue
            data[bound.html_name] = "" if value is None else value
    data.update(changes)
    return data


def _another_value(name: str, field: forms.Field, current: Any) -> tuple[Any, Any]:
    """A valid value other than ``current`` for a form field: (as the model holds it, as posted)."""
    if name in SAMPLE_EDITS:
        other = SAMPLE_EDITS[name](current)
        return other, other
    if isinstance(field, EnvField):  # the names kept as they are, one variable added
        other = {**current, "HF_HOME": "/data/hf"}
        return other, "\n".join([*current, "HF_HOME=/data/hf"])
    if isinstance(field, forms.JSONField):  # before CharField: JSONField is one
        other = [*current, "--edited"]
        return other, json.dumps(other)
    if isinstance(field, forms.ModelChoiceField):
        other = next(row for row in field.queryset if row != current)
        return other, other.pk
    if isinstance(field, forms.ChoiceField):
        other = next(value for value, _ in field.choices if value and value != current)
        return other, other
    if isinstance(field, forms.FloatField):  # before IntegerField: FloatField is one
        return current * 2 or 1.0, current * 2 or 1.0
    if isinstance(field, forms.IntegerField):
        return current * 2 or 1, current * 2 or 1
    if isinstance(field, forms.CharField):
        return f"{current}-edited", f"{current}-edited"
    raise AssertionError(f"no sample edit for a {type(field).__name__}: teach _another_value one")


def _plain(value: Any) -> Any:
    return str(value) if isinstance(value, models.Model) else value


def _audited(name: str, value: Any) -> Any:
    """A field's value as an edit's audit row keeps it: an argv as a shell line, an environment as
    its names."""
    if name == "entrypoint":
        return shlex.join(value)
    if name == "env":
        return ", ".join(sorted(value))
    return _plain(value)


def _errors(response) -> Any:
    context = response.context
    return context["adminform"].form.errors if context and "adminform" in context else response.status_code


def _new_rows(after_id: int) -> list[ElasticEvent]:
    return list(ElasticEvent.objects.filter(id__gt=after_id))


def _last_id() -> int:
    return ElasticEvent.objects.order_by("-id").values_list("id", flat=True).first() or 0


def _check_change(client, model_admin, obj) -> None:
    """Read-only (no change permission, a POST refused), or every editable field's edit is one
    audit row with its before and after, and the change is made."""
    model, url = type(obj), _url(type(obj), "change", obj.pk)
    page = client.get(url)
    editable = list(page.context["adminform"].form.fields)
    if not model_admin.has_change_permission(page.wsgi_request, obj):
        assert not editable, model
        last = _last_id()
        assert client.post(url, _posted(page)).status_code == 403, model
        assert not _new_rows(last), model
        return
    assert editable, f"{model._meta.label}: a change permission with nothing to change re-saves a stale row"
    for name in editable:
        page = client.get(url)
        obj.refresh_from_db()
        old = getattr(obj, name)
        new, posted = _another_value(name, page.context["adminform"].form.fields[name], old)
        along = ALONG_WITH[name](obj) if name in ALONG_WITH else {}
        last = _last_id()
        response = client.post(url, _posted(page, **{name: posted}, **along))
        assert response.status_code == 302, (model._meta.label, name, _errors(response))
        rows = _new_rows(last)
        assert len(rows) == 1, (model._meta.label, name, rows)
        inputs = rows[0].reason["inputs"]
        before, after = _audited(name, old), _audited(name, new)
        assert (inputs["before"][name], inputs["after"][name]) == (before, after), (model, name)
        assert describe_changes({name: before}, {name: after}) in rows[0].reason["text"]
        assert SECRET not in json.dumps(rows[0].reason), (model, name)
        assert "False" not in rows[0].reason["text"] and "True" not in rows[0].reason["text"]
        obj.refresh_from_db()
        assert getattr(obj, name) == new, (model._meta.label, name)


def _check_delete(client, model_admin, request, obj) -> None:
    """No delete permission (a POST refused), or a delete that is refused without a trace or
    audited by exactly one row; never a bulk delete that would skip the per-row answer."""
    model, url = type(obj), _url(type(obj), "delete", obj.pk)
    last = _last_id()
    if not model_admin.has_delete_permission(request, obj):
        assert client.post(url, {"post": "yes"}).status_code == 403, model
        assert model._default_manager.filter(pk=obj.pk).exists()
        return
    assert "delete_selected" not in model_admin.get_actions(request), model
    client.post(url, {"post": "yes"})
    if model._default_manager.filter(pk=obj.pk).exists():
        assert not _new_rows(last), model
    else:
        assert len(_new_rows(last)) == 1, model


def _check_add(client, model_admin, request, model) -> None:
    """No add permission, or an add that is one audit row (and may then be deleted or refused
    as any row)."""
    url = _url(model, "add")
    if not model_admin.has_add_permission(request):
        assert client.get(url).status_code == 403, model
        return
    assert model in ADD_EXAMPLES, f"{model._meta.label} may be added: give the walk an example"
    last = _last_id()
    response = client.post(url, _posted(client.get(url), **ADD_EXAMPLES[model]))
    assert response.status_code == 302, (model._meta.label, _errors(response))
    assert len(_new_rows(last)) == 1, model
    added = model._default_manager.get(**ADD_EXAMPLES[model])
    _check_delete(client, model_admin, request, added)


def test_every_admin_page_is_read_only_or_saves_through_an_audited_action(cluster, admin_client_logged_in):
    client = admin_client_logged_in
    walked = []
    for model, model_admin in admin.site._registry.items():
        if model in OUTSIDE_THE_AUDIT_LOG:
            continue
        assert client.get(_url(model, "changelist")).status_code == 200, model
        assert not model_admin.list_editable, f"{model._meta.label}: list edits would skip the change form's checks"
        obj = model._default_manager.order_by("pk").first()
        assert obj is not None, f"the cluster fixture makes no {model._meta.label}: make one through its action"
        page = client.get(_url(model, "change", obj.pk))
        assert page.status_code == 200, model
        _check_change(client, model_admin, obj)
        assert SECRET not in client.get(_url(model, "change", obj.pk)).content.decode(), model
        assert SECRET not in client.get(_url(model, "changelist")).content.decode(), model
        _check_add(client, model_admin, page.wsgi_request, model)
        _check_delete(client, model_admin, page.wsgi_request, obj)
        walked.append(model._meta.label)
    assert {"jobs.Node", "jobs.Job", "jobs.ElasticEvent", "telemetry.TelemetrySource"} <= set(walked)


def test_the_token_list_revokes_through_the_audited_action(admin_client_logged_in, operator, other_researcher):
    """An operator revokes API tokens from the admin's list: each selected token stops
    authenticating, with one audit row naming it by its prefix; one already revoked is said, not
    revoked twice; the token itself is on no page."""
    from jobs.models import ApiToken

    kept, _ = actions.issue_api_token(operator, other_researcher, label="ci")
    first, token = actions.issue_api_token(operator, other_researcher, label="laptop")
    second, _ = actions.issue_api_token(operator, operator)
    actions.revoke_api_token(operator, second)
    mark = _last_id()
    changelist = _url(ApiToken, "changelist")
    assert token not in admin_client_logged_in.get(changelist).content.decode()
    answer = admin_client_logged_in.post(changelist, {"action": "revoke", "_selected_action": [first.pk, second.pk]},
                                         follow=True)
    assert answer.status_code == 200
    said = [str(m) for m in answer.context["messages"]]
    assert f"{second}: API token {second.prefix}… was already revoked at " in "\n".join(said), said  # words, not a dict
    assert "Revoked: 1 done." in said
    rows = _new_rows(mark)
    assert [(row.kind, row.actor) for row in rows] == [("token_revoked", "root")]
    assert f"{first.prefix}…" in rows[0].reason["text"] and token not in json.dumps(rows[0].reason)
    first.refresh_from_db(), kept.refresh_from_db()
    assert first.revoked_at is not None and kept.revoked_at is None
    revoked = admin_client_logged_in.get(changelist, {"state": "revoked"}).content.decode()
    assert first.prefix in revoked and kept.prefix not in revoked
    live = admin_client_logged_in.get(changelist, {"state": "live"}).content.decode()
    assert kept.prefix in live and first.prefix not in live


def test_operators_reach_every_admin_list_and_an_auditor_not_the_tokens(client, django_user_model):
    """The admin is an operator's browser: with the role's permissions as the migrations leave
    them (0002, then 0013 for the models added since), a staff operator opens every registered
    list; an auditor, staff or not, gets no token list. Granted here on each migration's own model
    state, as ``migrate`` does (a transactional test may have flushed the groups' permissions)."""
    import importlib

    from django.contrib.auth.models import Group
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    from jobs.models import ApiToken
    from jobs.roles import AUDITOR, OPERATOR

    loader = MigrationExecutor(connection).loader
    for name in ("0002_roles", "0013_operator_admin_views"):
        migration = importlib.import_module(f"jobs.migrations.{name}")
        (migration.create_roles if name == "0002_roles" else migration.grant)(
            loader.project_state(("jobs", name)).apps, None)
    users = {}
    for role in (OPERATOR, AUDITOR):
        users[role] = django_user_model.objects.create_user(f"staff-{role}", password="x-pass-1234", is_staff=True)
        users[role].groups.add(Group.objects.get(name=role))
    client.force_login(users[OPERATOR])
    for model in admin.site._registry:
        if model not in OUTSIDE_THE_AUDIT_LOG:
            assert client.get(_url(model, "changelist")).status_code == 200, model._meta.label
    client.force_login(users[AUDITOR])
    assert client.get(_url(ApiToken, "changelist")).status_code == 403


def test_node_edit_is_one_audit_row_with_before_after_and_a_sentence(make_nodes, operator):
    node = make_nodes()[1]
    actions.edit_node(node, operator, gpu_model="H200-141GB", rack="r0")
    event = ElasticEvent.objects.get()
    assert event.kind == "node_edited"
    assert event.reason["text"] == "olive changed node r0s0n1: gpu model H100-80GB → H200-141GB."
    assert event.reason["inputs"] == {"node": "r0s0n1", "before": {"gpu_model": "H100-80GB"},
                                      "after": {"gpu_model": "H200-141GB"}}
    assert event.nodes_before == event.nodes_after == ["r0s0n1"]


def test_gpu_count_below_a_held_gpu_is_refused_on_the_form(admin_client_logged_in, make_nodes, make_job):
    node = make_nodes()[0]
    job = make_job(dp=4, dp_min=4, dp_max=4)
    actions.place_job(job, [(node, index) for index in range(4)], actor="planner", reason=PLACED)
    url = _url(Node, "change", node.pk)
    last = _last_id()
    response = admin_client_logged_in.post(url, _posted(admin_client_logged_in.get(url), gpu_count=3))
    assert response.status_code == 200
    assert "r0s0n0 cannot have 3 GPUs: GPU 3 is held by job-0" in str(_errors(response)["gpu_count"])
    node.refresh_from_db()
    assert node.gpu_count == 8
    assert not _new_rows(last)
    response = admin_client_logged_in.post(url, _posted(admin_client_logged_in.get(url), gpu_count=4))
    assert response.status_code == 302
    assert [row.reason["text"] for row in _new_rows(last)] == ["root changed node r0s0n0: gpu count 8 → 4."]


def test_gpu_count_below_a_held_gpu_is_refused_by_the_action(make_nodes, make_job, operator):
    node = make_nodes()[0]
    actions.place_job(make_job(), [(node, 5), (node, 6)], actor="planner", reason=PLACED)
    with pytest.raises(ValidationError, match="GPU 6 is held by job-0; keep at least 7"):
        actions.edit_node(node, operator, gpu_count=6)


def test_node_with_history_cannot_be_deleted(admin_client_logged_in, make_nodes, operator):
    node = make_nodes()[0]
    actions.cordon_node(node, operator)  # one audit row names it
    last = _last_id()
    response = admin_client_logged_in.get(_url(Node, "delete", node.pk), follow=True)
    assert response.redirect_chain[-1][0] == _url(Node, "change", node.pk)
    assert [str(m) for m in response.context["messages"]] == [
        "r0s0n0 has history (audit rows: 1) and cannot be deleted; cordon it to keep it out of service."
    ]
    admin_client_logged_in.post(_url(Node, "delete", node.pk), {"post": "yes"})
    assert Node.objects.filter(pk=node.pk).exists()
    assert not _new_rows(last)
    with pytest.raises(ValidationError, match="cannot be deleted"):
        actions.remove_node(node, operator)


def test_node_that_once_held_gpus_cannot_be_deleted(make_nodes, make_job, operator):
    node = make_nodes()[0]
    job = actions.place_job(make_job(), [(node, 0), (node, 1)], actor="planner", reason=PLACED)
    actions.cancel_job(job, operator)  # frees the GPUs; the allocation history and commands stay
    assert not node.allocations.exists()
    refusal = actions.node_removal_refusal(node)
    assert "allocation spans: 2" in refusal
    assert "commands: 1" in refusal


def test_node_without_history_is_deleted_and_audited(admin_client_logged_in, make_nodes, operator):
    node = make_nodes()[3]
    response = admin_client_logged_in.post(_url(Node, "delete", node.pk), {"post": "yes"})
    assert response.status_code == 302
    assert not Node.objects.filter(pk=node.pk).exists()
    event = ElasticEvent.objects.get()
    assert (event.kind, event.nodes_before) == ("node_removed", ["r0s1n1"])
    assert event.reason["text"].startswith("root removed node r0s1n1 (8x H100-80GB)")
    registered = actions.register_node(operator, name="r0s1n1", rack="r0", switch="r0s1", gpu_count=4)
    actions.edit_node(registered, operator, gpu_count=8)
    actions.remove_node(registered, operator)  # its own registration and edit are not history
    assert [row.kind for row in ElasticEvent.objects.all()] == [
        "node_removed", "node_registered", "node_edited", "node_removed"
    ]


def test_running_job_keeps_its_spec_and_its_owner_change_is_audited(admin_client_logged_in, make_nodes, make_job,
                                                                     other_researcher, operator):
    node = make_nodes()[0]
    job = actions.place_job(make_job(), [(node, 0), (node, 1)], actor="planner", reason=PLACED)
    url = _url(Job, "change", job.pk)
    page = admin_client_logged_in.get(url)
    assert list(page.context["adminform"].form.fields) == ["owner", "priority", "min_run_s", "max_restarts"]
    response = admin_client_logged_in.post(url, _posted(page, owner=other_researcher.pk))
    assert response.status_code == 302
    event = ElasticEvent.objects.get(kind="job_edited")
    assert event.reason["text"] == "root changed job job-0: owner rita → rob."
    assert event.reason["inputs"]["before"] == {"owner": "rita"}
    job.refresh_from_db()
    assert job.owner == other_researcher
    with pytest.raises(ValidationError, match="only a pending job's tp can change; job-0 is running"):
        actions.edit_job(job, operator, tp=2)


def test_pending_job_spec_change_recomputes_accumulation(make_job, operator):
    job = actions.edit_job(make_job(), operator, global_batch=128)
    assert (job.dp, job.accum_steps) == (2, 16)
    event = ElasticEvent.objects.get(kind="job_edited")
    assert event.reason["text"] == "olive changed job job-0: global batch 64 → 128, accum steps 8 → 16."
    assert (event.accum_before, event.accum_after) == (8, 16)


def test_a_spec_that_breaks_the_batch_is_a_form_error(admin_client_logged_in, make_job):
    job = make_job()
    url = _url(Job, "change", job.pk)
    response = admin_client_logged_in.post(url, _posted(admin_client_logged_in.get(url), micro_batch=5))
    assert response.status_code == 200
    assert "does not split into 2 replicas of micro-batch 5" in str(_errors(response)["micro_batch"])
    assert not ElasticEvent.objects.filter(kind="job_edited").exists()


def test_a_refusal_after_the_form_was_checked_is_a_message(admin_client_logged_in, make_job, monkeypatch):
    # As if the job changed between the form's check and the action's (which runs under lock).
    job = make_job()
    monkeypatch.setattr(JobForm, "validate", staticmethod(lambda job, changes: job))
    url = _url(Job, "change", job.pk)
    response = admin_client_logged_in.post(url, _posted(admin_client_logged_in.get(url), micro_batch=5), follow=True)
    assert response.redirect_chain[-1][0] == url
    assert "does not split into 2 replicas of micro-batch 5" in " ".join(map(str, response.context["messages"]))
    job.refresh_from_db()
    assert job.micro_batch == 4


def test_ended_job_is_view_only_and_no_job_is_deleted(admin_client_logged_in, make_job, operator):
    job = actions.cancel_job(make_job(), operator)
    assert job.state == JobState.CANCELLED
    page = admin_client_logged_in.get(_url(Job, "change", job.pk))
    assert admin_client_logged_in.post(_url(Job, "change", job.pk), _posted(page)).status_code == 403
    assert admin_client_logged_in.post(_url(Job, "delete", job.pk), {"post": "yes"}).status_code == 403


def test_critical_job_with_a_reservation_keeps_its_priority(make_job, operator):
    job = make_job(owner=operator, priority=Priority.CRITICAL, dp=1, dp_min=1, dp_max=1, global_batch=8,
                   micro_batch=8)
    actions.create_reservation(operator, name="window", job=job, gpus=2, start_at=timezone.now())
    with pytest.raises(ValidationError, match="only critical jobs hold reservations: cancel window first"):
        actions.edit_job(job, operator, priority=Priority.REGULAR)
    with pytest.raises(ValidationError, match="reservation window holds 2 GPUs, not a whole number of 4x1"):
        actions.edit_job(job, operator, tp=4)


def test_admin_drain_action_goes_through_the_audited_action(admin_client_logged_in, make_nodes):
    node = make_nodes()[0]
    response = admin_client_logged_in.post(
        "/admin/jobs/node/", {"action": "drain", "_selected_action": [node.pk]}, follow=True
    )
    assert response.status_code == 200
    node.refresh_from_db()
    assert node.state == NodeState.DRAINING
    assert ElasticEvent.objects.get().kind == "drain"


def test_env_is_edited_by_name_and_its_values_are_never_shown(admin_client_logged_in, make_job):
    job = make_job(env={"WANDB_API_KEY": SECRET, "HF_HOME": "/data/hf"})
    url = _url(Job, "change", job.pk)
    page = admin_client_logged_in.get(url)
    assert SECRET not in page.content.decode() and "/data/hf" not in page.content.decode()
    assert page.context["adminform"].form["env"].value() == "HF_HOME\nWANDB_API_KEY"
    # WANDB_API_KEY kept as it is, HF_HOME replaced, NCCL_DEBUG added.
    response = admin_client_logged_in.post(url, _posted(page, env="WANDB_API_KEY\nHF_HOME=/scratch/hf\nNCCL_DEBUG=INFO"))
    assert response.status_code == 302, _errors(response)
    job.refresh_from_db()
    assert job.env == {"WANDB_API_KEY": SECRET, "HF_HOME": "/scratch/hf", "NCCL_DEBUG": "INFO"}
    event = ElasticEvent.objects.get(kind="job_edited")
    assert event.reason["inputs"]["before"] == {"env": "HF_HOME, WANDB_API_KEY"}
    assert event.reason["inputs"]["after"] == {"env": "HF_HOME (new value), NCCL_DEBUG, WANDB_API_KEY"}
    assert "/scratch/hf" not in str(event.reason) and SECRET not in str(event.reason)
    # A name left out is removed; an untouched form changes nothing.
    page = admin_client_logged_in.get(url)
    admin_client_logged_in.post(url, _posted(page))
    assert ElasticEvent.objects.filter(kind="job_edited").count() == 1
    admin_client_logged_in.post(url, _posted(page, env="NCCL_DEBUG"))
    job.refresh_from_db()
    assert job.env == {"NCCL_DEBUG": "INFO"}


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ("OMNI_JOB=x", "OMNI_JOB is set by Omni and torchrun for every rank"),
        ("2FAST=x", "'2FAST' is not a variable name"),
        ("NEW_ONE", "line 2: NEW_ONE has no value yet: write NEW_ONE=VALUE"),
        ("A=1\nA=2", "line 3: A is listed twice"),
    ],
)
def test_a_bad_env_is_a_form_error_that_shows_no_value(admin_client_logged_in, make_job, env, message):
    job = make_job(env={"WANDB_API_KEY": SECRET})
    url = _url(Job, "change", job.pk)
    response = admin_client_logged_in.post(url, _posted(admin_client_logged_in.get(url),
                                                        env=f"WANDB_API_KEY=also-{SECRET}\n{env}"))
    assert response.status_code == 200
    assert message in " ".join(_errors(response)["env"])
    assert SECRET not in response.content.decode()
    job.refresh_from_db()
    assert job.env == {"WANDB_API_KEY": SECRET}


def test_a_workload_edit_follows_submits_rules(admin_client_logged_in, make_job):
    job = make_job()  # dp 2 in [1, 4]
    url = _url(Job, "change", job.pk)
    page = admin_client_logged_in.get(url)
    response = admin_client_logged_in.post(url, _posted(page, integration="signal"))
    assert response.status_code == 200
    errors = _errors(response)
    assert "signal-mode jobs are not elastic: dp_min must equal dp (2), not 1" in str(errors["dp_min"])
    assert "signal-mode jobs are not elastic: dp_max must equal dp (2), not 4" in str(errors["dp_max"])
    response = admin_client_logged_in.post(url, _posted(page, workdir="relative", entrypoint='"train.py"'))
    assert set(_errors(response)) == {"workdir", "entrypoint"}
    response = admin_client_logged_in.post(url, _posted(page, entrypoint='["train.py", "--fast"]', grace_s=0))
    assert set(_errors(response)) == {"grace_s"}
    assert not ElasticEvent.objects.filter(kind="job_edited").exists()
    response = admin_client_logged_in.post(url, _posted(page, integration="signal", dp_min=2, dp_max=2,
                                                        entrypoint='["train.py", "--fast"]'))
    assert response.status_code == 302, _errors(response)
    job.refresh_from_db()
    assert (job.integration, job.entrypoint, job.dp_min, job.dp_max) == ("signal", ["train.py", "--fast"], 2, 2)
    event = ElasticEvent.objects.get(kind="job_edited")
    assert "entrypoint -m trainer_agent.reference → train.py --fast" in event.reason["text"]


def test_a_running_jobs_env_shows_its_names_only(admin_client_logged_in, make_nodes, make_job):
    node = make_nodes()[0]
    job = actions.place_job(make_job(env={"WANDB_API_KEY": SECRET}), [(node, 0), (node, 1)], actor="planner",
                            reason=PLACED)
    page = admin_client_logged_in.get(_url(Job, "change", job.pk))
    assert "env" not in page.context["adminform"].form.fields
    content = page.content.decode()
    assert "WANDB_API_KEY" in content and SECRET not in content
