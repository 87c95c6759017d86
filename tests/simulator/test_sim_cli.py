"""The simulate command line: table, JSON, events and the --html hook."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from jobs.simulator.cli import main

SCENARIO = str(Path(__file__).resolve().parents[2] / "jobs" / "scenarios" / "spares-node-failure.json")


def test_without_json_prints_the_policies_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([SCENARIO]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("scenario: spares-node-failure")
    for policy in ("omni", "static", "kill_preempt"):
        assert any(line.startswith(policy) for line in out.splitlines())


def test_json_for_one_policy_is_one_object_and_all_is_a_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([SCENARIO, "--policy", "omni", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["policy"] == "omni" and "events" not in one
    assert main([SCENARIO, "--policy", "all", "--json", "--events"]) == 0
    many = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in many] == ["omni", "static", "kill_preempt", "slurm", "kueue", "elastic"]
    kinds = {e["kind"] for e in many[0]["events"]}
    assert {"place", "reclaim", "recover"} <= kinds


def test_html_calls_the_report_module(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[tuple[list[dict], str]] = []
    fake = types.ModuleType("jobs.simulator.report")
    fake.write_html = lambda results, path: calls.append((results, str(path)))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "jobs.simulator.report", fake)
    import jobs.simulator

    monkeypatch.setattr(jobs.simulator, "report", fake, raising=False)
    target = tmp_path / "r.html"
    assert main([SCENARIO, "--policy", "omni", "--html", str(target)]) == 0
    capsys.readouterr()
    assert len(calls) == 1 and calls[0][1] == str(target)
    assert calls[0][0][0]["policy"] == "omni" and calls[0][0][0]["timeline"]
