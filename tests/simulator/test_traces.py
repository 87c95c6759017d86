"""Trace import: shared/traces CSVs become valid, deterministic FORMAT.md scenarios; bad input exits 2."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from jobs.simulator.traces import (
    TraceError,
    TraceJob,
    build_scenario,
    default_options,
    import_trace,
    read_trace,
)

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO.parent / "shared" / "traces"
if not TRACES.exists():
    TRACES = Path("/work/shared/traces")
PHILLY = TRACES / "philly" / "philly.csv"
ACME = TRACES / "acme-kalos" / "kalos.csv"

TOP_KEYS = {"name", "comment", "horizon_s", "seed", "cluster", "jobs", "reservations", "events", "policy"}
JOB_KEYS = {"name", "owner", "priority", "submit_s", "tp", "pp", "dp", "dp_min", "dp_max", "global_batch",
            "micro_batch", "total_steps", "step_s", "step_cv", "comm_fraction", "checkpoint", "idle_phases", "min_run_s"}
RESERVATION_KEYS = {"name", "job", "gpus", "spares", "start_s", "end_s", "period_s", "active_s"}

needs_traces = pytest.mark.skipif(not PHILLY.exists() or not ACME.exists(), reason="shared traces not present")


@functools.cache
def philly_jobs() -> tuple[TraceJob, ...]:
    """The Philly trace, read once per test session (73,000 rows)."""
    return tuple(read_trace("philly", PHILLY))


def philly_slice(**overrides: object) -> dict:
    """The first 400 jobs of the shipped Philly window: fast, but with critical jobs and reservations."""
    options = replace(default_options("philly"), max_jobs=400, days=2.0, **overrides)
    return build_scenario("philly", list(philly_jobs()), options)


def acme_slice(**overrides: object) -> dict:
    """Two compressed weeks of Acme Kalos (the whole file is only 319 rows)."""
    return import_trace("acme", ACME, replace(default_options("acme"), **overrides))


def assert_follows_format(scenario: dict) -> None:
    """The FORMAT.md rules an importer can break, checked without the simulator."""
    assert set(scenario) <= TOP_KEYS
    cluster = scenario["cluster"]
    gpus_per_node = cluster["gpus_per_node"] if "gpus_per_node" in cluster else cluster["nodes"][0]["gpus"]
    cluster_gpus = (cluster["racks"] * cluster["switches_per_rack"] * cluster["nodes_per_switch"] * gpus_per_node
                    if "racks" in cluster else sum(node["gpus"] for node in cluster["nodes"]))
    names = [job["name"] for job in scenario["jobs"]]
    assert len(names) == len(set(names))
    by_name = {job["name"]: job for job in scenario["jobs"]}
    for job in scenario["jobs"]:
        assert set(job) <= JOB_KEYS, set(job) - JOB_KEYS
        assert job["priority"] in ("critical", "regular", "best_effort")
        assert 0 <= job["submit_s"] < scenario["horizon_s"]
        assert job["tp"] <= gpus_per_node and gpus_per_node % job["tp"] == 0
        dp_min, dp_max = job.get("dp_min", job["dp"]), job.get("dp_max", job["dp"])
        assert 1 <= dp_min <= job["dp"] <= dp_max
        assert dp_min * job["tp"] * job["pp"] <= cluster_gpus
        for d in {dp_min, job["dp"], dp_max}:
            assert job["global_batch"] % (job["micro_batch"] * d) == 0, (job["name"], d)
        assert job["total_steps"] >= 1 and job["step_s"] > 0
        assert set(job["checkpoint"]) == {"every_steps", "save_s", "load_s"}
        for phase in job.get("idle_phases", []):
            assert set(phase) == {"every_steps", "duration_s"}
    for reservation in scenario["reservations"]:
        assert set(reservation) <= RESERVATION_KEYS
        job = by_name[reservation["job"]]
        assert job["priority"] == "critical"
        assert reservation["gpus"] % (job["tp"] * job["pp"]) == 0
        assert 0 <= reservation["start_s"] < reservation["end_s"] <= scenario["horizon_s"]
        assert ("period_s" in reservation) == ("active_s" in reservation)


def validate_with_simulator(scenario: dict, tmp_path: Path) -> None:
    """Load the scenario with the simulator's own loader when it exists."""
    try:
        from jobs.simulator import scenario as scenario_module  # noqa: PLC0415
    except ImportError:
        return
    loader = getattr(scenario_module, "load_scenario", None)
    if loader is None:
        return
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps(scenario))
    loader(path)


@needs_traces
def test_philly_slice_follows_the_scenario_format(tmp_path: Path) -> None:
    scenario = philly_slice()
    assert_follows_format(scenario)
    validate_with_simulator(scenario, tmp_path)
    assert len(scenario["jobs"]) == 400
    assert scenario["reservations"], "the slice must keep critical jobs with reservations"
    assert "docs/traces.md" in scenario["comment"]


@needs_traces
def test_acme_slice_has_large_pretrain_jobs_and_reserved_critical_ones(tmp_path: Path) -> None:
    scenario = acme_slice()
    assert_follows_format(scenario)
    validate_with_simulator(scenario, tmp_path)
    sizes = {job["tp"] * job["pp"] * job["dp"] for job in scenario["jobs"]}
    assert {256, 512, 1024} <= sizes
    critical = [job for job in scenario["jobs"] if job["priority"] == "critical"]
    assert len(critical) >= 2
    assert all(job["tp"] <= 8 for job in scenario["jobs"])
    assert any("period_s" in r for r in scenario["reservations"])
    assert any("period_s" not in r for r in scenario["reservations"])


@needs_traces
def test_reservations_leave_reserved_gpus_idle_before_their_jobs_arrive() -> None:
    scenario = philly_slice()
    submit = {job["name"]: job["submit_s"] for job in scenario["jobs"]}
    assert any(r["start_s"] < submit[r["job"]] for r in scenario["reservations"])
    assert all("idle_phases" in job for job in scenario["jobs"] if job["priority"] == "critical")


@needs_traces
def test_import_is_deterministic_for_a_seed() -> None:
    assert philly_slice(seed=7) == philly_slice(seed=7)
    assert philly_slice(seed=7)["jobs"] != philly_slice(seed=8)["jobs"]


@needs_traces
def test_shipped_scenarios_are_what_the_importer_builds() -> None:
    shipped = json.loads((REPO / "jobs" / "scenarios" / "acme-llm.json").read_text())
    assert shipped == import_trace("acme", ACME)


@needs_traces
def test_shipped_philly_week_has_five_thousand_jobs_on_about_a_thousand_gpus() -> None:
    shipped = json.loads((REPO / "jobs" / "scenarios" / "philly-week.json").read_text())
    assert len(shipped["jobs"]) >= 5000
    assert shipped["horizon_s"] == 7 * 86400
    cluster = shipped["cluster"]
    assert cluster["racks"] * cluster["switches_per_rack"] * cluster["nodes_per_switch"] * cluster["gpus_per_node"] == 1024
    assert_follows_format(shipped)


def test_missing_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        import_trace("philly", tmp_path / "absent.csv")


def test_wrong_columns_are_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("timestamp,seconds,num_gpus\n2017-10-01 00:00:00,10,1\n")
    with pytest.raises(TraceError, match="missing column.*duration"):
        import_trace("philly", path)


def test_bad_value_names_row_and_column(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("job_id,arrival_time,num_iteration,gpu_workers,gpu_per_worker,profiled_network\n"
                    "0,0,100,8,8,1000\n1,10,lots,8,8,500\n")
    with pytest.raises(TraceError, match=r"row 2: column num_iteration: 'lots'"):
        import_trace("acme", path)


def run_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "manage.py", "import_trace", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_command_bad_input_exits_2_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("timestamp,duration,num_gpus\n2017-10-01 00:00:00,10,1\n2017-10-01 00:01:00,10,-2\n")
    done = run_command("philly", str(path), "--out", str(tmp_path / "out.json"))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "row 2: column num_gpus" in lines[0]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out.json").exists()


def test_command_bad_option_exits_2_with_one_line(tmp_path: Path) -> None:
    done = run_command("acme", str(tmp_path / "missing.csv"), "--out", str(tmp_path / "o.json"), "--gpus", "1001")
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1
    assert "--gpus" in done.stderr


def test_command_unknown_source_or_bad_number_exits_2_with_one_line(tmp_path: Path) -> None:
    for args in (("nope", "x.csv", "--out", "o.json"), ("acme", "x.csv", "--out", "o.json", "--days", "many")):
        done = run_command(*args)
        assert done.returncode == 2
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@needs_traces
def test_command_writes_the_scenario(tmp_path: Path) -> None:
    out = tmp_path / "acme.json"
    done = run_command("acme", str(ACME), "--out", str(out), "--days", "3", "--seed", "3")
    assert done.returncode == 0, done.stderr
    scenario = json.loads(out.read_text())
    assert scenario["seed"] == 3
    assert scenario["horizon_s"] == 3 * 86400
    assert_follows_format(scenario)


def test_another_window_gets_its_own_scenario_name():
    from jobs.simulator.traces import options_with

    assert options_with("philly", {}).name == "philly-week"
    assert options_with("philly", {"days": 1.0}).name == "philly-day49-1d"
    assert options_with("philly", {"days": 1.0, "name": "mine"}).name == "mine"
