"""Strict writes: every write endpoint answers 400 for a field it does not take (nothing written),
and a job's workload is checked at submit: a signal-mode job is not elastic, its environment's
names are checked, and its values are never shown back in full, in the API or the audit log."""

from __future__ import annotations

import json

import pytest

from jobs import actions, roles
from jobs.models import REFERENCE_ENTRYPOINT, ElasticEvent, Job, Node, NodeState, Reservation
from tests.conftest import api_client

pytestmark = pytest.mark.django_db

SPEC = dict(name="sft-a", priority="regular", tp=2, pp=1, dp=4, dp_min=2, dp_max=8,
            global_batch=128, micro_batch=4, total_steps=1000, step_s=2.0)
WORKLOAD = dict(entrypoint=["train.py", "--lr", "3e-4"], workdir="/data/sft", integration="omni", grace_s=45,
                max_restarts=2, keep_checkpoints=5, env={"HF_HOME": "/data/hf", "WANDB_API_KEY": "wandb-secret-42"})
RES = {"name": "win", "job": "omni-7b", "gpus": 16, "spares": 8, "start_at": "2026-12-01T10:00:00Z"}
NODE = {"name": "r5s0n0", "rack": "r5", "switch": "r5s0", "gpu_count": 8, "gpu_model": "H200-141GB"}


@pytest.fixture
def written(operator, make_job, make_nodes):
    """A pending job, a healthy node and a reservation, to write to."""
    nodes = make_nodes()
    job = make_job(owner=operator)
    critical = make_job(owner=operator, name="omni-7b", priority="critical", tp=8, dp=2, dp_min=2, dp_max=2,
                        global_batch=256, micro_batch=4)
    reservation = api_client(operator).post("/api/reservations/", RES, format="json").json()
    team = actions.create_team(operator, name="vision", quota_gpus=8)
    actions.add_team_member(team, operator, operator)
    return {"job": job, "node": nodes[0], "critical": critical, "reservation": reservation["id"], "team": team}


def _state(written) -> tuple:
    """What a refused write must leave as it was."""
    return (
        ElasticEvent.objects.count(),
        Job.objects.count(),
        Node.objects.count(),
        list(Job.objects.values_list("state", flat=True).order_by("pk")),
        list(Node.objects.values_list("state", flat=True).order_by("pk")),
        list(Reservation.objects.values("gpus", "spares", "cancelled_at", "name")),
    )


# (method, path as the schema names it, the row its {id} is, a valid body): every write endpoint.
WRITES = [
    ("post", "/api/jobs/", None, lambda: SPEC),
    ("post", "/api/jobs/{id}/cancel/", "job", dict),
    ("post", "/api/nodes/", None, lambda: NODE),
    ("post", "/api/nodes/{id}/cordon/", "node", dict),
    ("post", "/api/nodes/{id}/uncordon/", "node", dict),
    ("post", "/api/nodes/{id}/drain/", "node", dict),
    ("post", "/api/nodes/{id}/repair/", "node", dict),
    ("post", "/api/reservations/", None, lambda: {**RES, "name": "win-2"}),
    ("put", "/api/reservations/{id}/", "reservation", lambda: RES),
    ("patch", "/api/reservations/{id}/", "reservation", lambda: {"gpus": 24}),
    ("post", "/api/reservations/{id}/cancel/", "reservation", dict),
    ("post", "/api/teams/", None, lambda: {"name": "speech"}),
    ("patch", "/api/teams/{id}/", "team", lambda: {"weight": 2}),
    ("post", "/api/teams/{id}/members/", "team", lambda: {"user": "rita"}),
    ("post", "/api/teams/{id}/members/{username}/default/", "team", dict),
]


def _pk(written, row: str | None) -> int | None:
    return None if row is None else getattr(written[row], "pk", written[row])


@pytest.mark.parametrize(("method", "path", "row", "body"), WRITES, ids=[f"{m} {p}" for m, p, _, _ in WRITES])
def test_an_unknown_field_is_400_naming_it_and_nothing_is_written(operator, written, method, path, row, body):
    before = _state(written)
    url = path.replace("{id}", str(_pk(written, row))).replace("{username}", "olive")
    response = getattr(api_client(operator), method)(url, {**body(), "comand": "x"}, format="json")
    assert response.status_code == 400, response.content
    assert response.json() == {"comand": ["Unknown field."]}
    assert _state(written) == before


def test_every_write_endpoint_of_the_api_is_in_that_list(researcher):
    """A new write endpoint must join WRITES, and so be shown to refuse unknown fields. (Telemetry
    ingestion is the agents', checked sample by sample in tests/telemetry.)"""
    paths = api_client(researcher).get("/api/schema/?format=json").json()["paths"]
    writes = {(method, path) for path, methods in paths.items() if not path.startswith("/api/telemetry/")
              for method in methods if method in ("post", "put", "patch")}
    assert writes == {(method, path) for method, path, _, _ in WRITES}


def test_a_read_only_field_sent_in_a_write_is_refused(operator, written):
    client = api_client(operator)
    response = client.patch(f"/api/reservations/{written['reservation']}/", {"gpus": 24, "created_at": "2020-01-01"},
                            format="json")
    assert response.status_code == 400
    assert response.json() == {"created_at": ["This field is read-only."]}
    response = client.post("/api/jobs/", {**SPEC, "state": "running", "committed_steps": 999}, format="json")
    assert response.json() == {"state": ["Unknown field."], "committed_steps": ["Unknown field."]}


def test_unknown_and_invalid_fields_are_reported_together(researcher):
    response = api_client(researcher).post("/api/jobs/", {**SPEC, "tp": 0, "command": "python train.py"},
                                           format="json")
    assert response.status_code == 400
    body = response.json()
    assert body["command"] == ["Unknown field."] and set(body) == {"tp", "command"}


def test_a_form_encoded_body_is_strict_too(researcher, make_job):
    job = make_job()
    response = api_client(researcher).post(f"/api/jobs/{job.pk}/cancel/", {"why": "done"})
    assert response.status_code == 400 and response.json() == {"why": ["Unknown field."]}
    job.refresh_from_db()
    assert job.state == "pending"


# -- the workload at submit ---------------------------------------------------------------------


def test_a_workload_is_stored_and_shown_back_with_its_env_masked(researcher):
    response = api_client(researcher).post("/api/jobs/", {**SPEC, **WORKLOAD}, format="json")
    assert response.status_code == 201, response.content
    job = Job.objects.get()
    assert (job.entrypoint, job.workdir, job.env, job.integration) == (
        ["train.py", "--lr", "3e-4"], "/data/sft", WORKLOAD["env"], "omni")
    assert (job.grace_s, job.max_restarts, job.keep_checkpoints) == (45, 2, 5)
    body = response.json()
    assert body["env"] == {"HF_HOME": "***", "WANDB_API_KEY": "***"}
    assert (body["entrypoint"], body["workdir"], body["grace_s"], body["max_restarts"]) == (
        ["train.py", "--lr", "3e-4"], "/data/sft", 45.0, 2)
    assert (body["restarts"], body["run_id"], body["failure"], body["keep_checkpoints"]) == (0, "", {}, 5)
    shown = api_client(researcher).get(f"/api/jobs/{job.pk}/").content.decode()
    assert "wandb-secret-42" not in shown and "/data/hf" not in shown


def test_the_submit_audit_row_names_the_env_but_not_its_values(researcher):
    api_client(researcher).post("/api/jobs/", {**SPEC, **WORKLOAD}, format="json")
    event = ElasticEvent.objects.get(kind="submit")
    inputs = event.reason["inputs"]
    assert inputs["env"] == ["HF_HOME", "WANDB_API_KEY"]
    assert inputs["entrypoint"] == ["train.py", "--lr", "3e-4"] and inputs["integration"] == "omni"
    assert "running train.py --lr 3e-4 (omni)" in event.reason["text"]
    assert "wandb-secret-42" not in json.dumps(event.reason) and "/data/hf" not in json.dumps(event.reason)
    audit = api_client(researcher).get("/api/events/").content.decode()
    assert "wandb-secret-42" not in audit


def test_a_job_without_a_workload_runs_the_reference_trainer(researcher):
    body = api_client(researcher).post("/api/jobs/", SPEC, format="json").json()
    assert body["entrypoint"] == list(REFERENCE_ENTRYPOINT)
    assert (body["integration"], body["grace_s"], body["max_restarts"], body["keep_checkpoints"]) == (
        "omni", 30.0, 0, 3)
    assert (body["workdir"], body["env"]) == ("", {})


def test_others_see_no_workload_in_a_summary(researcher, other_researcher, settings):
    settings.OMNI_JOB_VISIBILITY = "summary"
    job_id = api_client(researcher).post("/api/jobs/", {**SPEC, **WORKLOAD}, format="json").json()["id"]
    seen = api_client(other_researcher).get(f"/api/jobs/{job_id}/").json()
    assert seen["visibility"] == "summary"
    assert not {"entrypoint", "workdir", "env", "failure", "integration"} & set(seen)
    assert not {"entrypoint", "workdir", "env", "failure"} & set(roles.SUMMARY_FIELDS)


def test_a_signal_job_defaults_its_dp_bounds_to_dp(researcher):
    spec = {k: v for k, v in SPEC.items() if k not in ("dp_min", "dp_max")}
    response = api_client(researcher).post("/api/jobs/", {**spec, "integration": "signal"}, format="json")
    assert response.status_code == 201, response.content
    assert (response.json()["dp_min"], response.json()["dp"], response.json()["dp_max"]) == (4, 4, 4)


@pytest.mark.parametrize(
    ("bounds", "fields"),
    [({"dp_min": 2, "dp_max": 8}, {"dp_min", "dp_max"}), ({"dp_min": 4, "dp_max": 8}, {"dp_max"}),
     ({"dp_min": 2}, {"dp_min"})],
)
def test_an_elastic_signal_job_is_400_naming_the_bound(researcher, bounds, fields):
    spec = {k: v for k, v in SPEC.items() if k not in ("dp_min", "dp_max")}
    response = api_client(researcher).post("/api/jobs/", {**spec, **bounds, "integration": "signal"}, format="json")
    assert response.status_code == 400
    body = response.json()
    assert set(body) == fields
    for field in fields:
        assert body[field] == [f"signal-mode jobs are not elastic: {field} must equal dp (4), not {bounds[field]}"]
    assert not Job.objects.exists() and not ElasticEvent.objects.exists()


def test_an_oversized_tensor_parallel_group_is_400_naming_tp(researcher, make_nodes):
    make_nodes(gpus=8)
    response = api_client(researcher).post("/api/jobs/", {**SPEC, "tp": 16, **WORKLOAD}, format="json")
    assert response.status_code == 400
    assert response.json() == {"tp": ["16 GPUs per tensor-parallel group but the largest node has 8"]}


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"1ABC": "x"}, "'1ABC' is not a variable name (letters, digits and _, not first a digit)"),
        ({"MY-VAR": "x"}, "'MY-VAR' is not a variable name (letters, digits and _, not first a digit)"),
        ({"": "x"}, "'' is not a variable name (letters, digits and _, not first a digit)"),
        ({"OMNI_JOB": "x"}, "OMNI_JOB is set by Omni and torchrun for every rank"),
        ({"RANK": "0"}, "RANK is set by Omni and torchrun for every rank"),
        ({"MASTER_PORT": "1"}, "MASTER_PORT is set by Omni and torchrun for every rank"),
        ({"CUDA_VISIBLE_DEVICES": "0"}, "CUDA_VISIBLE_DEVICES is set by Omni and torchrun for every rank"),
        ({"TORCHELASTIC_RUN_ID": "x"}, "TORCHELASTIC_RUN_ID is set by Omni and torchrun for every rank"),
        ({f"V{i}": "x" for i in range(101)}, "at most 100 variables, not 101"),
    ],
)
def test_a_bad_env_name_is_400_naming_env_without_its_value(researcher, env, message):
    response = api_client(researcher).post("/api/jobs/", {**SPEC, "env": env}, format="json")
    assert response.status_code == 400
    assert response.json() == {"env": [message]}
    assert not Job.objects.exists()


def test_a_good_env_name_is_accepted(researcher):
    env = {"_PRIVATE": "", "hf_home": "/x", "NCCL_DEBUG": "INFO", "OMNIBUS": "1"}
    assert api_client(researcher).post("/api/jobs/", {**SPEC, "env": env}, format="json").status_code == 201


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"entrypoint": []}, "entrypoint"),
        ({"entrypoint": "python train.py"}, "entrypoint"),
        ({"entrypoint": ["train.py", ""]}, "entrypoint"),
        ({"entrypoint": ["x" * 4097]}, "entrypoint"),
        ({"entrypoint": ["a"] * 257}, "entrypoint"),
        ({"entrypoint": [1, 2]}, "entrypoint"),
        ({"workdir": "relative/dir"}, "workdir"),
        ({"env": {"A": "x" * 4097}}, "env"),
        ({"env": ["A=1"]}, "env"),
        ({"env": {"A": 1}}, "env"),
        ({"integration": "slurm"}, "integration"),
        ({"grace_s": 0}, "grace_s"),
        ({"grace_s": 3601}, "grace_s"),
        ({"max_restarts": 101}, "max_restarts"),
        ({"max_restarts": -1}, "max_restarts"),
        ({"keep_checkpoints": 0}, "keep_checkpoints"),
        ({"keep_checkpoints": 101}, "keep_checkpoints"),
    ],
)
def test_a_bad_workload_field_is_400_naming_it(researcher, change, field):
    response = api_client(researcher).post("/api/jobs/", {**SPEC, **change}, format="json")
    assert response.status_code == 400, response.content
    assert list(response.json()) == [field]
    assert not Job.objects.exists() and not ElasticEvent.objects.exists()


def test_the_limits_themselves_are_accepted(researcher):
    workload = {"entrypoint": ["x" * 4096] * 256, "grace_s": 3600, "max_restarts": 100, "keep_checkpoints": 100,
                "env": {f"V{i}": "x" * 4096 for i in range(100)}, "workdir": "/"}
    assert api_client(researcher).post("/api/jobs/", {**SPEC, **workload}, format="json").status_code == 201


# -- POST /api/nodes/ ---------------------------------------------------------------------------


def test_an_operator_registers_a_node_and_it_is_audited(operator):
    response = api_client(operator).post("/api/nodes/", NODE, format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["name"], body["gpu_count"], body["gpu_model"], body["state"]) == ("r5s0n0", 8, "H200-141GB",
                                                                                  NodeState.HEALTHY)
    event = ElasticEvent.objects.get()
    assert (event.kind, event.actor, event.nodes_after) == ("node_registered", "olive", ["r5s0n0"])


def test_a_node_without_a_gpu_model_gets_the_default(operator):
    body = {k: v for k, v in NODE.items() if k != "gpu_model"}
    assert api_client(operator).post("/api/nodes/", body, format="json").json()["gpu_model"] == "H100-80GB"


@pytest.mark.parametrize("role", ["researcher", "auditor", "outsider"])
def test_only_operators_register_nodes(request, role):
    response = api_client(request.getfixturevalue(role)).post("/api/nodes/", NODE, format="json")
    assert response.status_code == 403
    assert not Node.objects.exists() and not ElasticEvent.objects.exists()


def test_a_duplicate_node_name_is_400_naming_name(operator):
    client = api_client(operator)
    assert client.post("/api/nodes/", NODE, format="json").status_code == 201
    response = client.post("/api/nodes/", {**NODE, "rack": "r6"}, format="json")
    assert response.status_code == 400 and list(response.json()) == ["name"]
    assert Node.objects.count() == 1 and ElasticEvent.objects.count() == 1


@pytest.mark.parametrize(("change", "field"), [({"gpu_count": 0}, "gpu_count"), ({"name": ""}, "name"),
                                               ({"rack": None}, "rack")])
def test_a_bad_node_field_is_400_naming_it(operator, change, field):
    response = api_client(operator).post("/api/nodes/", {**NODE, **change}, format="json")
    assert response.status_code == 400 and list(response.json()) == [field]
    assert not Node.objects.exists()
