"""``python -m bench.simulate``: every policy by default, their CPU times summed as
``philly_week_all_s`` (issue 15's speed target), on a small shipped scenario here (the week
itself is the benchmark's, not a test's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.simulate import TARGET_ALL_S, main
from jobs.simulator.policies import POLICIES

SCENARIO = str(Path(__file__).resolve().parents[2] / "jobs" / "scenarios" / "teams.json")


def test_all_policies_are_timed_and_summed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--scenario", SCENARIO, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out["policies"]) == list(POLICIES)
    cpu = out["cpu_s_by_policy"]
    assert set(cpu) == set(POLICIES) and all(v > 0 for v in cpu.values())
    assert out["philly_week_all_s"] == pytest.approx(sum(cpu.values()), abs=0.05)
    assert out["target_s"] == TARGET_ALL_S and out["within_target"] is (out["philly_week_all_s"] <= TARGET_ALL_S)
    assert out["cpu_ratio_to_static"]["static"] == 1.0
    assert out["policies"]["omni"]["invariant_violations"] == 0
    assert 0 < out["policies"]["omni"]["utilization"] <= 1
    for figures in out["policies"].values():
        where = figures["where_pct"]
        assert sum(where.values()) == pytest.approx(100, abs=0.01)
        assert where["useful"] == pytest.approx(figures["utilization"] * 100, abs=0.001)
    # teams.json: omni leads utilisation and keeps both bounds; elastic preempts nobody there.
    found = out["omni_verdict"]
    assert found["bounds_met"] is True and 0 < found["ahead_or_level"] < found["figures"]
    assert "utilization" not in found["behind"]
    assert found["behind"]["preemptions_per_completed_job"] == {"omni": pytest.approx(1 / 3, abs=1e-3), "elastic": 0.0}


def test_one_policy_prints_its_own_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--scenario", SCENARIO, "--policy", "kueue", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "kueue" and "philly_week_all_s" not in out and out["cpu_s"] > 0


def test_a_bad_scenario_file_is_one_line_and_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit) as exit_info:
        main(["--scenario", str(bad), "--json"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.json" in err[0] and "invalid JSON" in err[0]
