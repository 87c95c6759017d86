"""Every example in examples/ is submitted by a researcher through the real `omni` CLI (with an API
token) to a live server, with a Celery worker and two node agents, and must complete: its job
reaches `completed` with all its steps, its ranks said so in exit.json (the `omni` ones) and its
logs reached the server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib

import pytest

from tests.control_loop.conftest import ROOT, make_node, wait_for

pytestmark = [pytest.mark.services, pytest.mark.postgres, pytest.mark.redis, pytest.mark.torch,
              pytest.mark.slow, pytest.mark.timeout(900)]

EXAMPLES = sorted(p.parent for p in (ROOT / "examples").glob("*/job.toml"))


def test_there_are_four_examples_each_with_a_job_file_and_a_readme():
    assert [p.name for p in EXAMPLES] == ["ddp_library", "hf_trainer", "lightning", "signal_script"]
    for example in EXAMPLES:
        assert (example / "README.md").read_text().startswith("# ")
        spec = tomllib.loads((example / "job.toml").read_text())
        assert (example / spec["entrypoint"][0]).is_file(), example


def test_every_example_submitted_through_the_cli_completes(control_cluster, boss, researcher):
    from jobs import actions
    from jobs.models import Job, JobLogLine

    _row, token = actions.issue_api_token(boss, researcher)
    tokens = [make_node(f"n{i}", 4)[1] for i in range(2)]
    control_cluster.start_server()
    control_cluster.start_worker()
    for i, node_token in enumerate(tokens):
        control_cluster.start_agent(f"n{i}", node_token, gpus=4)
    env = {**os.environ, "OMNI_URL": control_cluster.url, "OMNI_TOKEN": token,
           "XDG_CONFIG_HOME": str(control_cluster.tmp / "cfg")}

    def omni(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "trainer_agent.cli", *args], env=env, cwd=control_cluster.tmp,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (args, done.stdout, done.stderr)
        return done.stdout

    names = {}
    for example in EXAMPLES:
        submitted = json.loads(omni("submit", str(example / "job.toml"), "--json"))
        names[example.name] = submitted["name"]
        assert submitted["owner"] == researcher.username

    def states() -> dict[str, str]:
        return {name: json.loads(omni("status", name, "--json"))["state"] for name in names.values()}

    def all_ended() -> dict[str, str] | None:
        now = states()
        return now if all(s in ("completed", "failed", "cancelled") for s in now.values()) else None

    ended = wait_for(all_ended, 780, "every example to end", every_s=3)
    assert ended == dict.fromkeys(names.values(), "completed"), (ended, control_cluster.logs()[-6000:])
    for example, name in names.items():
        job = Job.objects.get(name=name)
        assert job.committed_steps == job.total_steps, example
        assert JobLogLine.objects.filter(job=job).exists(), f"{example}: no log line reached the server"
        if job.integration == "omni":
            outcome = json.loads((control_cluster.tmp / "runs" / name / "exit.json").read_text())
            assert outcome["outcome"] == "completed" and outcome["step"] == job.total_steps, (example, outcome)
