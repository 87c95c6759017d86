"""The dashboard's submit form: who sees it, a submit through ``submit_job`` that lands on the job
page, refusals shown on their fields, environment values never rendered back, the live preview
endpoint (``check_submission``: the same rules, nothing saved) and CSRF; and once in Chromium:
a TP larger than any node is named under its field as it is typed, then fixed, previewed and
submitted (the fixtures of tests/live/test_browser.py)."""

from __future__ import annotations

import re

import pytest
from django.test import Client
from django.urls import reverse

from jobs.models import ElasticEvent, Job
from tests.live import test_browser as shared

# Three switches of two 4-GPU nodes; one of them has a 8-GPU node instead.
SWITCHES = 3


@pytest.fixture
def nodes(make_nodes):
    from jobs.models import Node

    made = make_nodes(racks=1, switches=SWITCHES, nodes=2, gpus=4)
    Node.objects.filter(name="r0s0n0").update(gpu_count=8)
    return made


def client_for(user, *, csrf: bool = False) -> Client:
    client = Client(enforce_csrf_checks=csrf)
    client.force_login(user)
    return client


FORM = {
    "name": "sft-7b", "priority": "regular", "entrypoint": "train.py --config 'sft run.yaml'", "workdir": "/data/sft",
    "env": "HF_HOME=/data/hf\nWANDB_API_KEY=s3cret-value-123", "integration": "omni", "grace_s": "30",
    "max_restarts": "2", "tp": "4", "pp": "1", "dp": "2", "dp_min": "1", "dp_max": "4", "global_batch": "64",
    "micro_batch": "4", "total_steps": "1000", "step_s": "2.5", "checkpoint_every_steps": "200",
}


def form(**changes: str) -> dict[str, str]:
    return {**FORM, **changes}


@pytest.mark.django_db
class TestSubmitForm:
    def test_a_researcher_sees_the_form_without_the_critical_class(self, researcher, nodes):
        page = client_for(researcher).get("/").content.decode()
        assert 'id="submit-form"' in page and 'action="/jobs/new/"' in page
        select = re.search(r'<select name="priority" id="submit_priority">.*?</select>', page, re.S)[0]
        assert 'value="regular" selected' in select and 'value="best_effort"' in select
        assert 'value="critical"' not in select

    def test_an_operator_may_choose_critical(self, operator, nodes):
        page = client_for(operator).get("/").content.decode()
        assert 'value="critical"' in re.search(r'<select name="priority" id="submit_priority">.*?</select>', page, re.S)[0]

    def test_an_auditor_sees_no_form_and_may_not_post(self, auditor, nodes):
        client = client_for(auditor)
        page = client.get("/")
        assert page.status_code == 200 and 'id="submit-form"' not in page.content.decode()
        assert client.post("/jobs/new/", form()).status_code == 403
        assert client.post("/jobs/preview/", form()).status_code == 403
        assert not Job.objects.exists()

    def test_a_valid_post_creates_the_job_and_lands_on_its_page(self, researcher, nodes):
        response = client_for(researcher).post("/jobs/new/", form(), follow=True)
        job = Job.objects.get()
        assert response.redirect_chain == [(reverse("job-page", args=[job.pk]), 302)]
        assert "Submitted sft-7b: 8 GPUs wanted" in response.content.decode()
        assert job.owner == researcher and (job.tp, job.dp, job.dp_min, job.dp_max, job.accum_steps) == (4, 2, 1, 4, 8)
        assert job.entrypoint == ["train.py", "--config", "sft run.yaml"] and job.workdir == "/data/sft"
        assert job.env == {"HF_HOME": "/data/hf", "WANDB_API_KEY": "s3cret-value-123"}
        assert (job.max_restarts, job.step_s, job.checkpoint_every_steps, job.total_steps) == (2, 2.5, 200, 1000)
        assert ElasticEvent.objects.get(job=job).reason["inputs"]["env"] == ["HF_HOME", "WANDB_API_KEY"]

    def test_signal_mode_forces_the_dp_bounds_to_dp(self, researcher, nodes):
        client_for(researcher).post("/jobs/new/", form(integration="signal", grace_s="45", dp_min="1", dp_max="8"))
        job = Job.objects.get()
        assert (job.integration, job.dp_min, job.dp, job.dp_max, job.grace_s) == ("signal", 2, 2, 2, 45.0)

    def test_a_bad_post_shows_field_messages_creates_nothing_and_keeps_env_values_out(self, researcher, nodes):
        response = client_for(researcher).post("/jobs/new/", form(tp="16", global_batch="100", workdir="data"))
        page = response.content.decode()
        assert response.status_code == 400 and not Job.objects.exists()
        assert 'data-errors-for="tp"><li>16 GPUs per tensor-parallel group but the largest node has 8</li>' in page
        assert 'data-errors-for="global_batch"><li>global batch 100 is not micro-batch 4 × dp 2' in page
        assert 'data-errors-for="workdir"><li>an absolute path' in page
        assert "s3cret-value-123" not in page and "/data/hf" not in page
        assert "HF_HOME\nWANDB_API_KEY</textarea>" in page  # the names come back, for the values to be retyped
        assert 'value="sft-7b"' in page and "<details class=\"card submit-job\" id=\"submit-job\" open>" in page

    def test_a_researcher_cannot_post_a_critical_job(self, researcher, nodes):
        response = client_for(researcher).post("/jobs/new/", form(priority="critical"))
        assert response.status_code == 400 and 'data-errors-for="priority"><li>Select a valid choice.' in \
            response.content.decode()
        assert not Job.objects.exists()

    def test_a_taken_name_is_named_on_its_field(self, researcher, nodes, make_job):
        make_job(name="sft-7b")
        response = client_for(researcher).post("/jobs/new/", form())
        assert response.status_code == 400
        assert 'data-errors-for="name"><li>a job named &#x27;sft-7b&#x27; already exists' in response.content.decode()

    def test_the_preview_answers_problems_per_field_without_saving(self, researcher, nodes):
        answer = client_for(researcher).post("/jobs/preview/", form(tp="16", env="OMNI_JOB=x\nHF_HOME=/a")).json()
        assert answer["errors"] == {
            "tp": ["16 GPUs per tensor-parallel group but the largest node has 8"],
            "env": ["OMNI_JOB is set by Omni and torchrun for every rank"],
        }
        assert answer["preview"] == ""  # no sentence for a layout that cannot run
        assert not Job.objects.exists()

    def test_the_preview_says_the_job_in_words(self, researcher, nodes):
        answer = client_for(researcher).post("/jobs/preview/", form()).json()
        assert answer == {"errors": {}, "preview": (
            "Needs 8 GPUs: 2 replicas of TP 4 (elastic: 1 to 4 replicas); accumulation 8 (global batch 64 = "
            "micro-batch 4 × 2 × 8); fits on 3 of 3 switches; 1000 steps × 2.5 s ≈ 41 min."
        )}
        answer = client_for(researcher).post("/jobs/preview/", form(tp="8", dp="1", dp_min="", dp_max="")).json()
        assert "Needs 8 GPUs: 1 replica of TP 8; accumulation 16" in answer["preview"]
        assert "fits on 1 of 3 switches" in answer["preview"]

    def test_the_preview_checks_an_unfinished_form_at_its_defaults(self, researcher, nodes):
        answer = client_for(researcher).post("/jobs/preview/", form(name="", entrypoint="train.py 'x", tp="2", dp="3",
                                                                        global_batch="50")).json()
        assert answer["errors"] == {
            "name": ["This field is required."],
            "entrypoint": ["not a shell-like line: No closing quotation"],
            "global_batch": ["global batch 50 is not micro-batch 4 × dp 3 × a whole number of accumulation steps "
                             "(12 does not divide 50)"],
        }
        assert answer["preview"] == "Needs 6 GPUs: 3 replicas of TP 2 (elastic: 1 to 4 replicas); fits on 3 of 3 " \
            "switches; 1000 steps × 2.5 s ≈ 41 min."

    def test_csrf_is_enforced_on_submit_and_preview(self, researcher, nodes):
        client = client_for(researcher, csrf=True)
        assert client.post("/jobs/new/", form()).status_code == 403
        assert client.post("/jobs/preview/", form()).status_code == 403
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', client.get("/").content.decode())[1]
        assert client.post("/jobs/preview/", form(), HTTP_X_CSRFTOKEN=token).status_code == 200
        assert client.post("/jobs/new/", form(csrfmiddlewaretoken=token)).status_code == 302
        assert Job.objects.filter(name="sft-7b").exists()

    def test_get_does_not_submit(self, researcher, nodes):
        assert client_for(researcher).get("/jobs/new/", form()).status_code == 405
        assert not Job.objects.exists()


# -- in Chromium -------------------------------------------------------------------------------

asgi_server = shared.asgi_server
shared_channel_layer = shared.shared_channel_layer
browser = shared.browser
open_as = shared.open_as


@pytest.mark.browser
@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_researcher_sees_a_tp_problem_live_fixes_it_and_lands_on_the_job_page(open_as, asgi_server, researcher,
                                                                                make_nodes):
    shared.in_thread(lambda: make_nodes(racks=1, switches=SWITCHES, nodes=2, gpus=4))
    page = open_as(researcher)
    assert page.locator("#submit-job").get_attribute("open") is not None  # no jobs yet: the form is open
    page.fill("#submit_tp", "16")
    problem = page.locator("[data-errors-for=tp] li")
    problem.wait_for(timeout=3000)
    assert problem.inner_text() == "16 GPUs per tensor-parallel group but the largest node has 4"
    assert page.locator("#submit-preview").inner_text() == ""
    assert page.locator("[data-errors-for=name] li").count() == 0  # empty and untouched: no "required" yet
    shared.shot(page, "submit-form-problem")

    page.fill("#submit_name", "live-form")
    page.fill("#submit_tp", "4")
    page.wait_for_function("document.querySelector('#submit-preview').textContent.includes('fits on')")
    assert page.locator("[data-errors-for=tp] li").count() == 0
    assert page.locator("#submit-preview").inner_text().startswith("Needs 8 GPUs: 2 replicas of TP 4")
    shared.shot(page, "submit-form")

    page.click("#submit-form button[type=submit]")
    page.wait_for_url(re.compile(r".*/jobs/\d+/$"))
    assert "Submitted live-form" in page.locator(".messages").inner_text()
    assert shared.in_thread(lambda: Job.objects.get(name="live-form").tp) == 4
