"""The agent's side of checkpoint storage hygiene: runs-dir space, and removing a run dir safely."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from trainer_agent import launch
from trainer_agent.housekeeping import remove_run_dir, runs_dir_usage


def _run_dir(runs: Path, job: str, files: dict[str, bytes]) -> Path:
    run = runs / launch.safe_name(job)
    for name, data in files.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_bytes(data)
    return run


def test_runs_dir_usage_reports_the_file_system_of_the_runs_dir(tmp_path: Path) -> None:
    usage = runs_dir_usage(tmp_path)
    expected = shutil.disk_usage(tmp_path)
    assert set(usage) == {"free_bytes", "total_bytes"}
    assert all(isinstance(v, int) for v in usage.values())
    assert usage["total_bytes"] == expected.total
    assert 0 <= usage["free_bytes"] <= usage["total_bytes"]


def test_a_runs_dir_not_made_yet_reports_where_it_will_be(tmp_path: Path) -> None:
    assert runs_dir_usage(tmp_path / "not" / "yet")["total_bytes"] == shutil.disk_usage(tmp_path).total


def test_remove_run_dir_removes_it_and_counts_the_bytes(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, "team/job 7", {"ckpt/step-100.pt": b"x" * 1000, "logs/rank0.out": b"y" * 24})
    keep = _run_dir(tmp_path, "other", {"ckpt/step-5.pt": b"z"})
    assert remove_run_dir(tmp_path, "team/job 7") == {"removed": True, "bytes_freed": 1024}
    assert not run.exists()
    assert keep.exists() and tmp_path.exists()


def test_nothing_to_remove_is_not_an_error(tmp_path: Path) -> None:
    assert remove_run_dir(tmp_path, "never-ran") == {"removed": False, "bytes_freed": 0}
    assert remove_run_dir(tmp_path / "missing-runs-dir", "x") == {"removed": False, "bytes_freed": 0}


def test_hard_links_count_once_and_symlinked_files_are_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"o" * 500)
    runs = tmp_path / "runs"
    run = _run_dir(runs, "j", {"a.pt": b"a" * 100})
    os.link(run / "a.pt", run / "a-again.pt")
    os.symlink(outside, run / "link.pt")
    assert remove_run_dir(runs, "j") == {"removed": True, "bytes_freed": 100}
    assert outside.read_bytes() == b"o" * 500


@pytest.mark.parametrize("job", [".", "..", ""])
def test_names_that_are_not_a_dir_inside_the_runs_dir_are_refused(tmp_path: Path, job: str) -> None:
    runs = tmp_path / "runs"
    _run_dir(runs, "keep", {"a": b"1"})
    with pytest.raises(ValueError):
        remove_run_dir(runs, job)
    assert (runs / "keep" / "a").exists()


def test_a_run_dir_that_links_outside_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "precious"
    (elsewhere / "data").mkdir(parents=True)
    (elsewhere / "data" / "x").write_bytes(b"keep me")
    runs = tmp_path / "runs"
    runs.mkdir()
    os.symlink(elsewhere, runs / "job")
    with pytest.raises(ValueError, match="symbolic link"):
        remove_run_dir(runs, "job")
    assert (elsewhere / "data" / "x").read_bytes() == b"keep me"


def test_a_file_where_the_run_dir_should_be_is_refused(tmp_path: Path) -> None:
    (tmp_path / "job").write_bytes(b"not a dir")
    with pytest.raises(ValueError, match="not a directory"):
        remove_run_dir(tmp_path, "job")
