"""``omni teams`` and ``omni quota`` (trainer_agent/cli.py, docs/teams.md), and ``team`` in a job
file: in-process against the API's shapes, and end to end against the real server."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.cli.test_cli import GOOD, asgi_server, runner, write  # noqa: F401 (fixtures)
from trainer_agent import cli

VISION = {"id": 3, "name": "vision", "parent": "lab", "quota_gpus": 8, "borrow_limit_gpus": 4, "weight": 1.0,
          "members_count": 2, "gpus_held": 10, "words": "10 GPUs: 2 borrowed beyond its quota of 8; may borrow up to 4"}
LAB = {"id": 1, "name": "lab", "parent": None, "quota_gpus": 16, "borrow_limit_gpus": None, "weight": 2.5,
       "members_count": 0, "gpus_held": 10, "words": "10 of 16 guaranteed GPUs; may borrow any idle GPU"}
JOBS = [{"id": 7, "name": "vit-l", "owner": "rita", "priority": "regular", "state": "running", "gpus": 10},
        {"id": 9, "name": "vit-h", "owner": "rob", "priority": "regular", "state": "pending", "gpus": 0,
         "visibility": "summary"}]


@pytest.fixture
def fake_api(monkeypatch):
    """The API's answers for a team list and a team's detail."""
    monkeypatch.setenv("OMNI_URL", "http://omni.invalid")
    monkeypatch.setenv("OMNI_TOKEN", "t")
    asked: list = []

    def pages(self, path, params=(), limit=None):
        asked.append((path, dict(params)))
        rows = [LAB, VISION]
        if dict(params).get("mine") == "true":
            rows = [{**VISION, "default": True}]
        return iter(rows)

    def get(self, path, params=()):
        asked.append((path, dict(params)))
        if path == "/api/teams/3/":
            return {**VISION, "members": [], "jobs": JOBS, "reservations": []}
        raise AssertionError(path)

    monkeypatch.setattr(cli.Api, "pages", pages)
    monkeypatch.setattr(cli.Api, "get", get)
    return asked


def test_teams_is_one_line_per_team(runner, fake_api):  # noqa: F811
    result = runner.invoke(cli.main, ["teams"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["NAME", "PARENT", "GPUS/QUOTA", "BORROW", "LIMIT", "WEIGHT", "MEMBERS"]
    assert lines[1].split() == ["lab", "-", "10/16", "no", "limit", "2.5", "0"]
    assert lines[2].split() == ["vision", "lab", "10/8", "4", "1", "2"]


def test_quota_shows_a_teams_standing_what_it_may_take_and_its_jobs(runner, fake_api):  # noqa: F811
    result = runner.invoke(cli.main, ["quota", "vision"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "team      vision (in lab)" in out
    assert "in use    10 GPUs: 2 borrowed beyond its quota of 8; may borrow up to 4" in out
    assert "may take  0 GPUs within its quota, then 2 more beyond its quota" in out
    assert "running   1 jobs on 10 GPUs" in out and "waiting   1 jobs" in out
    assert "http://omni.invalid/teams/3/" in out
    assert [line.split()[:5] for line in out.splitlines()[-2:]] == [
        ["7", "vit-l", "rita", "regular", "running"], ["9", "vit-h", "rob", "regular", "pending"]]


def test_quota_without_a_team_is_the_callers_default_team(runner, fake_api):  # noqa: F811
    result = runner.invoke(cli.main, ["quota", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["name"] == "vision"
    assert ("/api/teams/", {"mine": "true", "limit": 200}) in fake_api


def test_an_unknown_team_is_exit_2_in_one_line(runner, fake_api):  # noqa: F811
    result = runner.invoke(cli.main, ["quota", "nope"])
    assert result.exit_code == 2
    assert result.stderr == "omni: error: no team 'nope' (omni teams lists them)\n"


def test_borrowing_room_in_words():
    assert cli.borrow_room_words({"gpus_held": 2, "quota_gpus": 8, "borrow_limit_gpus": None}) == \
        "6 GPUs within its quota, then any idle GPU beyond its quota"
    assert cli.borrow_room_words({"gpus_held": 12, "quota_gpus": 8, "borrow_limit_gpus": 4}) == \
        "0 GPUs within its quota, then nothing more beyond its quota (at its borrowing limit)"


def test_a_job_file_takes_a_team_and_refuses_a_wrong_type_on_its_line(tmp_path):
    assert cli.load_spec(write(tmp_path / "job.toml", GOOD + 'team = "vision"\n'))["team"] == "vision"
    with pytest.raises(cli.Failure) as caught:
        cli.load_spec(write(tmp_path / "bad.toml", GOOD + "team = 3\n"))
    assert caught.value.exit_code == 2
    assert caught.value.message == f"{tmp_path / 'bad.toml'}: line 7: team: expected a string, got a number (3)"


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_teams_and_quota_against_the_real_server(asgi_server, researcher, operator, tmp_path):  # noqa: F811
    from jobs import actions
    from jobs.models import Job

    actions.register_node(operator, name="r0s0n0", rack="r0", switch="r0s0", gpu_count=8)
    lab = actions.create_team(operator, name="lab", quota_gpus=8)
    vision = actions.create_team(operator, name="vision", parent=lab, quota_gpus=4, borrow_limit_gpus=2)
    actions.add_team_member(vision, operator, researcher)
    _row, token = actions.issue_api_token(operator, researcher)
    env = {**os.environ, "OMNI_URL": asgi_server, "OMNI_TOKEN": token, "XDG_CONFIG_HOME": str(tmp_path / "cfg")}

    def omni(*args: str, code: int = 0) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "trainer_agent.cli", *args], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == code, (args, done.stdout, done.stderr)
        return done

    job_file = write(tmp_path / "job.toml", GOOD + 'team = "vision"\n')
    omni("submit", str(job_file))
    assert Job.objects.get(name="sft").team == vision
    other = write(tmp_path / "other.toml", GOOD.replace('"sft"', '"sft-2"') + 'team = "lab"\n')
    assert omni("submit", str(other), code=2).stderr.startswith("omni: error: team: you are not in team lab")
    listed = omni("teams").stdout.splitlines()
    assert [line.split()[:3] for line in listed[1:]] == [["lab", "-", "0/8"], ["vision", "lab", "0/4"]]
    shown = omni("quota").stdout
    assert "team      vision (in lab)" in shown and "0 of 4 guaranteed GPUs; may borrow up to 2" in shown
    assert "sft" in shown.splitlines()[-1] and "pending" in shown.splitlines()[-1]
    assert omni("quota", "nope", code=2).stderr == "omni: error: no team 'nope' (omni teams lists them)\n"
