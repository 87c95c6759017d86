"""Scenario validation: a bad file gets exit status 2 and one line naming the field."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.simulator import ScenarioError, parse_scenario
from jobs.simulator.cli import main

GOOD = {
    "name": "ok",
    "horizon_s": 3600,
    "cluster": {"racks": 1, "switches_per_rack": 1, "nodes_per_switch": 2, "gpus_per_node": 8},
    "jobs": [
        {"name": "a", "priority": "regular", "dp": 1, "global_batch": 8, "micro_batch": 1,
         "total_steps": 10, "step_s": 1},
        {"name": "b", "priority": "critical", "tp": 8, "dp": 1, "global_batch": 8, "micro_batch": 1,
         "total_steps": 10, "step_s": 1},
        {"name": "c", "priority": "best_effort", "dp": 1, "global_batch": 8, "micro_batch": 1,
         "total_steps": 10, "step_s": 1},
        {"name": "d", "priority": "regular", "tp": 2, "dp": 1, "global_batch": 8, "micro_batch": 1,
         "total_steps": 10, "step_s": 1},
    ],
    "reservations": [{"name": "r", "job": "b", "gpus": 8}],
}


def _with(path: str, value: object) -> dict:
    data = copy.deepcopy(GOOD)
    target = data
    keys = path.split(".")
    for key in keys[:-1]:
        target = target[int(key)] if isinstance(target, list) else target[key]
    last = keys[-1]
    if isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value
    return data


def test_the_good_scenario_is_accepted() -> None:
    scenario = parse_scenario(GOOD)
    assert scenario.total_gpus == 16
    assert scenario.jobs[0].min_run_s == 7200.0  # regular jobs get the policy default
    assert scenario.jobs[2].min_run_s == 0.0
    assert scenario.reservations[0].nodes == ("r0s0n1",)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_with("jobs.3.tp", 16), "jobs[3].tp: 16 exceeds gpus_per_node 8"),
        (_with("jobs.0.colour", "red"), "jobs[0].colour: unknown key"),
        (_with("horizon", 5), "horizon: unknown key"),
        (_with("jobs.0.priority", "urgent"), "jobs[0].priority: must be one of critical, regular, best_effort"),
        (_with("jobs.0.micro_batch", 3), "jobs[0].global_batch: 8 is not divisible by micro_batch*dp = 3"),
        (_with("jobs.1.name", "a"), "jobs[1].name: duplicate job 'a'"),
        (_with("reservations.0.job", "a"), "reservations[0].job: 'a' is regular"),
        (_with("reservations.0.gpus", 4), "reservations[0].gpus: 4 is not a multiple of the job's replica size 8"),
        (_with("cluster.racks", 0), "cluster.racks: must be at least 1"),
        (_with("jobs.0.step_s", "fast"), 'jobs[0].step_s: must be a number, got "fast"'),
        (_with("events", [{"at_s": 1, "kind": "node_down", "node": "nope"}]), "events[0].node: no node named 'nope'"),
        (_with("events", [{"at_s": 1, "kind": "explode"}]), "events[0].kind: must be one of"),
        (_with("jobs.0.dp_min", 2), "jobs[0].dp_min: 2 exceeds dp 1"),
        (_with("policy", {"lend_past_grace": 1}), "policy.lend_past_grace: must be true or false, got 1"),
        (_with("policy", {"loan_loss_max_s": True}), "policy.loan_loss_max_s: must be a number, got true"),
    ],
)
def test_a_bad_field_is_named_in_one_line(data: dict, message: str) -> None:
    with pytest.raises(ScenarioError) as err:
        parse_scenario(data)
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_a_policy_switch_takes_true_or_false() -> None:
    assert parse_scenario(_with("policy", {"lend_past_grace": False})).planner_config("graceful").lend_past_grace is False
    assert parse_scenario(GOOD).planner_config("graceful").lend_past_grace is True


def test_missing_required_field_is_named() -> None:
    data = copy.deepcopy(GOOD)
    del data["jobs"][2]["step_s"]
    with pytest.raises(ScenarioError, match=r"^jobs\[2\]\.step_s: is required$"):
        parse_scenario(data)


def test_cli_exits_2_with_one_line_and_no_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_with("jobs.3.tp", 16)))
    assert main([str(bad)]) == 2
    captured = capsys.readouterr()
    assert captured.err == "jobs[3].tp: 16 exceeds gpus_per_node 8\n"
    assert captured.out == ""
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert main([str(broken)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert main([str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_manage_py_simulate_exits_2_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_with("jobs.3.tp", 16)))
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "manage.py"), "simulate", str(bad)],
                          capture_output=True, text=True, cwd=root, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["jobs[3].tp: 16 exceeds gpus_per_node 8"]
    assert "Traceback" not in proc.stderr
