"""The ``omni`` command line (trainer_agent/cli.py, docs/cli.md).

Parsing and credentials run in-process with click's CliRunner; the end-to-end test runs the CLI
as a real subprocess against ``manage.py serve`` (daphne) on the test database, the pattern of
tests/live/test_browser.py without the browser, with a real user, API token and nodes.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
from click.testing import CliRunner

from tests.live.server import database_url, serve
from trainer_agent import cli

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "tests" / "artifacts"
REDIS_DB = 12  # the server's Celery broker and channel layer: a database of its own


@pytest.fixture
def runner(tmp_path, monkeypatch):
    """A CliRunner with its own config dir and no credentials from the environment."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("OMNI_URL", raising=False)
    monkeypatch.delenv("OMNI_TOKEN", raising=False)
    return CliRunner()


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


GOOD = 'name = "sft"\ndp = 2\nglobal_batch = 32\nmicro_batch = 4\ntotal_steps = 10\nstep_s = 1.5\n'


# -- the job file -------------------------------------------------------------------------------

def test_a_toml_syntax_error_is_one_line_naming_the_line_and_exit_2(runner, tmp_path):
    job = write(tmp_path / "job.toml", 'name = "sft"\ndp = \n')
    result = runner.invoke(cli.main, ["submit", str(job)])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert f"{job}: line 2, column" in result.stderr


def test_an_unknown_key_is_one_line_naming_its_line(runner, tmp_path):
    job = write(tmp_path / "job.toml", GOOD + 'comand = ["train.py"]\n')
    result = runner.invoke(cli.main, ["submit", str(job)])
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1
    assert "line 7: comand: unknown field" in result.stderr


def test_an_unknown_table_is_an_unknown_key(tmp_path):
    job = write(tmp_path / "job.toml", GOOD + '[envs]\nA = "1"\n')
    with pytest.raises(cli.Failure, match=r"line 7: envs: unknown field; did you mean 'env'") as caught:
        cli.load_spec(job)
    assert caught.value.exit_code == 2


@pytest.mark.parametrize(("line", "words"), [
    ('dp = "two"', 'line 6: dp: expected an integer, got a string ("two")'),
    ("tp = true", "line 6: tp: expected an integer, got a boolean (true)"),
    ("entrypoint = \"train.py\"", "line 6: entrypoint: expected a list of strings"),
    ("entrypoint = [\"train.py\", 3]", "line 6: entrypoint: expected a list of strings"),
    ("env = { A = 1 }", "line 6: env: expected a table of strings"),
])
def test_a_wrong_type_names_its_line_and_field(tmp_path, line, words):
    job = write(tmp_path / "job.toml", GOOD.replace("dp = 2\n", "") + line + "\n")  # the 6th line
    with pytest.raises(cli.Failure) as caught:
        cli.load_spec(job)
    assert caught.value.exit_code == 2
    assert caught.value.message.startswith(f"{job}: {words}")


def test_a_relative_script_and_workdir_are_resolved_from_the_files_directory(tmp_path):
    job = write(tmp_path / "proj" / "jobs" / "job.toml",
                GOOD + 'entrypoint = ["../train.py", "--config", "sft.yaml"]\nworkdir = "."\n')
    write(tmp_path / "proj" / "train.py", "print('training')\n")
    spec = cli.load_spec(job)
    assert spec["entrypoint"] == [str(tmp_path / "proj" / "train.py"), "--config", "sft.yaml"]
    assert spec["workdir"] == str(tmp_path / "proj" / "jobs")


def test_a_relative_script_that_is_not_there_is_refused_before_submitting(runner, tmp_path):
    """Not a job that waits for GPUs and then fails with the rank's "can't open file"."""
    job = write(tmp_path / "job.toml", GOOD + 'entrypoint = ["trian.py"]\n')
    write(tmp_path / "train.py", "print('training')\n")
    result = runner.invoke(cli.main, ["submit", str(job)])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert f"{job}: line 7: entrypoint: trian.py: no such file ({tmp_path / 'trian.py'};" in result.stderr


def test_modules_absolute_paths_and_executables_are_left_as_written(tmp_path):
    for entrypoint in (["-m", "pkg.train"], ["/data/train.py"], ["bash", "run.sh"]):
        job = write(tmp_path / "job.toml", GOOD + f"entrypoint = {json.dumps(entrypoint)}\nworkdir = \"/data\"\n")
        spec = cli.load_spec(job)
        assert spec["entrypoint"] == entrypoint
        assert spec["workdir"] == "/data"


def test_the_example_job_file_is_valid(tmp_path):
    spec = cli.load_spec(ROOT / "examples" / "signal_script" / "job.toml")
    assert spec["integration"] == "signal"
    assert spec["entrypoint"][0] == str(ROOT / "examples" / "signal_script" / "train.py")


# -- credentials --------------------------------------------------------------------------------

@pytest.mark.parametrize("args", [["submit"], ["jobs", "--state", "bogus"], ["statu", "x"], ["logs", "--rank", "-1", "j"]])
def test_a_usage_error_is_one_line_and_exit_2(runner, args):
    result = runner.invoke(cli.main, args)
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.startswith("omni: error: ") and result.stderr.count("\n") == 1
    assert result.stderr.endswith("--help)\n")


def test_no_credentials_is_a_usage_error(runner):
    result = runner.invoke(cli.main, ["jobs"])
    assert result.exit_code == 2
    assert "not logged in" in result.stderr


def test_saved_credentials_are_private_and_the_environment_wins(runner, tmp_path, monkeypatch):
    path = cli.save_credentials("https://omni.example/", "secret-token")
    assert path == tmp_path / "config" / "omni" / "config.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert cli.load_credentials() == ("https://omni.example", "secret-token")
    monkeypatch.setenv("OMNI_URL", "http://other:8000")
    monkeypatch.setenv("OMNI_TOKEN", "env-token")
    assert cli.load_credentials() == ("http://other:8000", "env-token")


def test_logout_keep_token_forgets_what_is_stored_whatever_token_the_shell_holds(runner, monkeypatch):
    path = cli.save_credentials("https://omni.example/", "stored-token")
    monkeypatch.setenv("OMNI_TOKEN", "env-token")
    result = runner.invoke(cli.main, ["logout", "--keep-token"])
    assert result.exit_code == 0, result.output
    assert not path.exists()
    assert result.stdout == f"removed {path}; OMNI_TOKEN is still set in this shell.\n"
    again = runner.invoke(cli.main, ["logout", "--keep-token"])
    assert again.exit_code == 2 and "there are no stored credentials" in again.stderr

def test_an_unreachable_server_is_exit_1(runner, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    token = write(tmp_path / "token", "abc\n")
    result = runner.invoke(cli.main, ["login", "--url", f"http://127.0.0.1:{port}", "--token-file", str(token)])
    assert result.exit_code == 1
    assert "cannot reach" in result.stderr and "abc" not in result.output
    assert not cli.config_path().exists()
    prompted = runner.invoke(cli.main, ["login", "--url", f"http://127.0.0.1:{port}"], input="abc\n")
    assert prompted.exit_code == 1 and "abc" not in prompted.output


def test_a_400_is_printed_field_by_field():
    assert cli.api_error_words(400, {"dp": ["too big"], "name": ["taken", "bad"]}).splitlines() == [
        "dp: too big", "name: taken", "name: bad"]
    assert cli.ApiError(400, {}).exit_code == 2 and cli.ApiError(500, None).exit_code == 1


def test_tables_align_their_columns(runner):
    with runner.isolation() as (out, _err, _):
        cli.table(["A", "LONGER", "C"], [[1, "x", "end"], [22, "yyyyyyyy", ""]], "none")
    assert out.getvalue().decode().splitlines() == ["A   LONGER    C", "1   x         end", "22  yyyyyyyy"]


def test_the_queue_is_by_class_then_oldest_first(runner, monkeypatch):
    monkeypatch.setenv("OMNI_URL", "http://omni.invalid")
    monkeypatch.setenv("OMNI_TOKEN", "t")
    lists = {  # each as the API returns it: newest first
        "pending": [{"id": 5, "name": "e", "priority": "best_effort", "state": "pending"},
                    {"id": 4, "name": "d", "priority": "regular", "state": "pending"},
                    {"id": 1, "name": "a", "priority": "regular", "state": "pending"}],
        "preempted": [{"id": 3, "name": "c", "priority": "critical", "state": "preempted"}],
        "recovering": [{"id": 2, "name": "b", "priority": "regular", "state": "recovering"}],
    }
    monkeypatch.setattr(cli.Api, "pages", lambda self, path, params, limit=None: iter(lists[dict(params)["state"]]))
    result = runner.invoke(cli.main, ["queue", "--json"])
    assert result.exit_code == 0, result.output
    assert [row["name"] for row in json.loads(result.stdout)] == ["c", "a", "b", "d", "e"]


def test_shell_completion_is_clicks_own():
    done = subprocess.run([sys.executable, "-m", "trainer_agent.cli"], env={**os.environ, "_OMNI_COMPLETE": "bash_source"},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "_omni_completion()" in done.stdout


# -- end to end: the real CLI against a real ASGI server ----------------------------------------

@pytest.fixture(scope="module")
def asgi_server(django_db_setup, django_db_blocker):
    """``manage.py serve`` (daphne, no planner loop) on the test database."""
    # Without REDIS_URL the server runs Celery eagerly: a submit would run the planner pass at
    # once. With a Redis database of its own and no worker the jobs stay pending, and the tasks
    # the server enqueues reach no other test's worker (13 and 14 are the other suites').
    redis_url = os.environ.get("OMNI_TEST_REDIS_URL")
    if not redis_url:
        pytest.skip("needs Redis: the server must not run the planner eagerly")
    parts = urlsplit(redis_url)
    private = urlunsplit((parts.scheme, parts.netloc, f"/{REDIS_DB}", "", ""))
    import redis

    redis.Redis.from_url(private).flushdb()
    overrides = {"DATABASE_URL": database_url(django_db_blocker), "REDIS_URL": private,
                 "SECRET_KEY": "omni-cli-tests-not-secret"}
    with serve(overrides, "cli-server.log") as url:
        yield url
    redis.Redis.from_url(private).flushdb()


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_cli_drives_a_job_through_the_api(asgi_server, researcher, operator, tmp_path):
    from jobs import actions
    from jobs.models import Job, JobLogLine

    for n in range(2):
        actions.register_node(operator, name=f"r0s0n{n}", rack="r0", switch="r0s0", gpu_count=8)
    _row, token = actions.issue_api_token(operator, researcher)
    env = {**os.environ, "OMNI_URL": asgi_server, "OMNI_TOKEN": token, "XDG_CONFIG_HOME": str(tmp_path / "cfg")}

    def omni(*args: str, code: int = 0) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "trainer_agent.cli", *args], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == code, (args, done.stdout, done.stderr)
        assert token not in done.stdout + done.stderr
        return done

    submitted = omni("submit", str(ROOT / "examples" / "signal_script" / "job.toml"))
    job = Job.objects.get(name="ddp-plain")
    assert job.integration == "signal" and job.owner == researcher
    assert job.entrypoint[0] == str(ROOT / "examples" / "signal_script" / "train.py")
    assert f"{asgi_server}/jobs/{job.pk}/" in submitted.stdout

    # The server's 400: field by field, exit 2; a second job with the same name is one.
    refused = omni("submit", str(ROOT / "examples" / "signal_script" / "job.toml"), code=2)
    assert refused.stderr.startswith("omni: error: name: ")

    listed = omni("jobs", "--mine")
    assert listed.stdout.split("\n")[0].split() == ["ID", "NAME", "OWNER", "PRIORITY", "STATE", "GPUS", "STEPS", "SUBMITTED"]
    assert listed.stdout.split("\n")[1].split()[:7] == [str(job.pk), "ddp-plain", "rita", "regular", "pending", "0", "0/200"]
    rows = json.loads(omni("jobs", "--state", "pending", "--json").stdout)
    assert [r["name"] for r in rows] == ["ddp-plain"]

    status = omni("status", "ddp-plain").stdout
    assert "signal" in status and "steps        0/200, as its script reported (its checkpoints are its own" in status
    assert "last checkpoint at step" not in status
    assert json.loads(omni("status", str(job.pk), "--json").stdout)["id"] == job.pk
    omni("status", "no-such-job", code=2)

    assert omni("why", "ddp-plain").stdout.startswith("ddp-plain: Waiting since 20")
    assert omni("why", "ddp-plain").stdout.endswith(". The planner has not considered this job yet.\n")
    assert json.loads(omni("why", "ddp-plain", "--json").stdout)["state"] == "pending"

    queued = json.loads(omni("queue", "--json").stdout)
    assert [r["name"] for r in queued] == ["ddp-plain"]
    assert "ddp-plain" in omni("queue").stdout

    nodes = json.loads(omni("nodes", "--json").stdout)
    assert sorted(n["name"] for n in nodes) == ["r0s0n0", "r0s0n1"]
    assert "r0s0n1" in omni("nodes").stdout

    now = datetime.now(UTC)
    JobLogLine.objects.bulk_create(
        JobLogLine(job=job, run_id="ddp-plain-0", node="r0s0n0", rank=rank, stream="out", offset=i, at=now,
                   text=f"step {i} rank {rank}")
        for i in range(3) for rank in (0, 1)
    )
    printed = omni("logs", "ddp-plain").stdout.splitlines()
    assert printed[:2] == ["[rank 0] step 0 rank 0", "[rank 1] step 0 rank 1"] and len(printed) == 6
    only = [json.loads(line) for line in omni("logs", "ddp-plain", "--rank", "1", "--json").stdout.splitlines()]
    assert [line["text"] for line in only] == ["step 0 rank 1", "step 1 rank 1", "step 2 rank 1"]

    from jobs.models import Node

    node = Node.objects.get(name="r0s0n1")
    actions.place_job(job, [(node, 0), (node, 1)], actor="planner", reason={"rule": "place", "text": "Placed.", "inputs": {}})
    assert "nodes        r0s0n1\n" in omni("status", "ddp-plain").stdout
    cancelled = omni("cancel", "ddp-plain")
    assert "cancelled" in cancelled.stdout
    job.refresh_from_db()
    assert job.state == "cancelled"
    assert "ran on       r0s0n1\n" in omni("status", "ddp-plain").stdout  # where its last run was
    assert omni("cancel", "ddp-plain", code=1).stderr.startswith("omni: error: ")  # a 409
    # Following the log of an ended job prints what there is and returns.
    assert len(omni("logs", "-f", "ddp-plain").stdout.splitlines()) == 6

    # --wait follows the job with a line per change and exits 1 when it does not run.
    second = write(tmp_path / "second.toml", (ROOT / "examples" / "signal_script" / "job.toml").read_text()
                   .replace('name = "ddp-plain"', 'name = "ddp-second"').replace('"train.py"', f'"{ROOT}/examples/signal_script/train.py"'))
    waiting = subprocess.Popen([sys.executable, "-m", "trainer_agent.cli", "submit", "--wait", str(second)],
                               env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(60, waiting.kill)  # a stuck CLI must not hang the suite
    watchdog.start()
    try:
        assert waiting.stdout.readline().startswith("Submitted job ")
        assert waiting.stdout.readline() == "ddp-second: pending, step 0/200\n"
        actions.cancel_job(Job.objects.get(name="ddp-second"), researcher)
        out, err = waiting.communicate(timeout=30)
    finally:
        watchdog.cancel()
    assert waiting.returncode == 1, (out, err)
    assert out == "ddp-second: cancelled, step 0/200\n"
    assert err == "omni: error: ddp-second cancelled\n"

    # The researcher sees the audit rows of their own jobs.
    kinds = [r["kind"] for r in json.loads(omni("events", "ddp-plain", "--json").stdout)]
    assert kinds[0] == "submit" and "cancel" in kinds
    assert "cancel" in omni("events", "ddp-plain").stdout

    # login checks the token and stores it privately; then the environment is not needed.
    token_file = write(tmp_path / "token", token + "\n")
    bare = {k: v for k, v in env.items() if k not in ("OMNI_URL", "OMNI_TOKEN")}
    env = bare
    omni("login", "--url", asgi_server, "--token-file", str(token_file))
    assert stat.S_IMODE((tmp_path / "cfg" / "omni" / "config.json").stat().st_mode) == 0o600
    assert "ddp-plain" in omni("jobs").stdout
    write(tmp_path / "bad", "not-a-token\n")
    assert "omni: error:" in omni("login", "--url", asgi_server, "--token-file", str(tmp_path / "bad"), code=1).stderr


def test_an_outcome_reads_as_key_value_facts_not_a_python_dict():
    """`omni events` printed an outcome as "{'ack_ms': 647.4, 'attempts': 1, ...}"."""
    outcome = {"ack_ms": 647.4, "attempts": 1, "kind": "start", "ok": True, "checkpoint_step": None,
               "layout": [["n1", 0]], "note": ""}
    assert cli.facts(outcome) == 'ack_ms=647.4 attempts=1 kind=start ok=true layout=[["n1",0]]'
    assert cli.facts(None) == "" and cli.facts({}) == ""


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_logout_revokes_the_token_on_the_server_and_forgets_it(asgi_server, researcher, operator, tmp_path):
    from jobs import actions
    from jobs.models import ApiToken, ElasticEvent

    _row, token = actions.issue_api_token(operator, researcher, label="laptop")
    env = {k: v for k, v in os.environ.items() if k not in ("OMNI_URL", "OMNI_TOKEN")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "cfg")

    def omni(*args: str, code: int = 0, stdin: str | None = None) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "trainer_agent.cli", *args], env=env, cwd=tmp_path, input=stdin,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == code, (args, done.stdout, done.stderr)
        assert token not in done.stdout + done.stderr
        return done

    omni("login", "--url", asgi_server, "--token-file", "-", stdin=token + "\n")
    config = tmp_path / "cfg" / "omni" / "config.json"
    assert config.exists() and omni("jobs").returncode == 0
    out = omni("logout").stdout
    assert f"Revoked the API token {token[5:11]}… on {asgi_server}; removed {config}." in out
    assert not config.exists()
    assert ApiToken.objects.get(prefix=token[5:11]).revoked_at is not None
    row = ElasticEvent.objects.filter(kind="token_revoked").latest("id")
    assert row.reason["text"] == f"rita revoked API token {token[5:11]}… of rita (laptop)."
    # The token is dead for every client, and a second logout has nothing to forget.
    assert "not logged in" in omni("logout", code=2).stderr
    env.update(OMNI_URL=asgi_server, OMNI_TOKEN=token)
    assert "revoked" in omni("jobs", code=1).stderr
    gone = omni("logout").stdout
    assert "already refuses the token" in gone and "OMNI_TOKEN is still set in this shell" in gone
