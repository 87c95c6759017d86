"""The embedded mode boots from nothing: no environment, no servers, a fresh var/ directory."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from http.cookiejar import CookieJar
from pathlib import Path
from urllib.parse import urlencode

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bare_env(var_dir: Path) -> dict[str, str]:
    # Only what any shell has: no DATABASE_URL, REDIS_URL, SECRET_KEY or Django settings.
    keep = ("PATH", "HOME", "LANG", "TMPDIR", "SYSTEMROOT")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env["OMNI_VAR_DIR"] = str(var_dir)  # a fresh directory instead of the checkout's var/
    return env


@pytest.mark.slow
def test_embedded_mode_boots_from_nothing_and_serves_login_and_dashboard(tmp_path):
    env = _bare_env(tmp_path / "var")
    for command in (["migrate", "--noinput", "-v0"], ["seed_demo"]):
        result = subprocess.run([sys.executable, "manage.py", *command], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=180)
        assert result.returncode == 0, result.stderr
    assert (tmp_path / "var" / "omni.sqlite3").exists()
    assert "Demo logins" in result.stdout

    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "manage.py", "serve", "--port", str(port)], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                login_page = urllib.request.urlopen(f"{base}/login/", timeout=5).read().decode()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise AssertionError("server did not answer: " + (server.stdout.read() if server.poll() is not None else "")) from None
                time.sleep(0.5)
        assert "Log in to Omni" in login_page

        jar = CookieJar()
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        page = opener.open(f"{base}/login/", timeout=10).read().decode()
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
        form = urlencode({"username": "alice", "password": "omni-demo-pass", "csrfmiddlewaretoken": token})
        request = urllib.request.Request(f"{base}/login/", data=form.encode(), headers={"Referer": f"{base}/login/"})
        dashboard = opener.open(request, timeout=10).read().decode()
        assert "sft-chat" in dashboard  # alice's own job: the dashboard lists a researcher's jobs
        console = opener.open(f"{base}/console/", timeout=10).read().decode()
        assert "omni-7b" in console and "r0s0n0" in console  # the cluster map
        css = urllib.request.urlopen(f"{base}/static/css/omni.css", timeout=10)
        assert css.status == 200
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=20)


def test_dashboard_redirects_anonymous_users_to_login(client, db):
    response = client.get("/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")


def test_user_without_a_role_gets_a_clear_403(client, outsider):
    client.force_login(outsider)
    response = client.get("/")
    assert response.status_code == 403 and b"No role yet" in response.content


def test_seed_demo_builds_the_cluster_through_actions(db, capsys):
    from django.core.management import call_command

    from jobs.audit import verify_chain
    from jobs.models import Allocation, ElasticEvent, Job, Node, Reservation

    call_command("seed_demo")
    assert Node.objects.count() == 32 and Reservation.objects.count() == 2
    assert set(Job.objects.values_list("priority", flat=True)) == {"critical", "regular", "best_effort"}
    assert Allocation.objects.exists()
    assert ElasticEvent.objects.filter(kind="submit").count() == Job.objects.count()
    assert verify_chain().ok
    call_command("seed_demo")  # idempotent
    assert Node.objects.count() == 32


def test_the_demo_story_plays_once_per_database(db):
    """``make demo`` on a database whose story has played (its critical job has run) serves the
    cluster as it is and says how to start afresh, rather than announcing a loan, a reclaim and
    a resume that will not come again; the static seed has no story job and is unaffected."""
    from django.core.management import call_command
    from django.utils import timezone

    from jobs.management.commands.demo import STORY_CRITICAL_JOB, no_agents_because, story_played
    from jobs.models import Job, Node

    call_command("seed_demo", "--story")
    assert not story_played() and no_agents_because() is None
    Job.objects.filter(name=STORY_CRITICAL_JOB).update(first_started_at=timezone.now())
    assert story_played()
    Job.objects.filter(name=STORY_CRITICAL_JOB).update(name="another-7b")  # a cluster without the story's job
    assert not story_played()
    Node.objects.update(state="failed")  # an earlier run's agents all went silent: said, not silence
    assert "Every node of this database is failed" in no_agents_because()


@pytest.mark.django_db(transaction=True)  # the director closes old connections, as its thread must
def test_the_stories_last_step_reads_a_completion_that_came_before_it(monkeypatch):
    """Step 4 of ``make demo``'s story (the borrowers resume) reads the audit log from the reclaim,
    not from its own start: the story's critical job runs about two minutes and usually completes
    while the node failure is played, so watching from step 4 waited out the watch and said
    "still running" of a job that had finished. A job that has not finished is still waited for."""
    import io

    from django.core.management import call_command
    from django.db import transaction

    from jobs.audit import record_event as record_in_transaction
    from jobs.management.commands import demo
    from jobs.models import ElasticEvent, Job, Reservation

    def record_event(*args, **kwargs) -> None:
        with transaction.atomic():
            record_in_transaction(*args, **kwargs)

    from django.contrib.auth.models import Group

    from jobs.roles import ROLES

    for role in ROLES:  # a transactional test before this one flushed the groups the migration made
        Group.objects.get_or_create(name=role)
    call_command("seed_demo", "--story")
    reservation = Reservation.objects.get(job__name=demo.STORY_CRITICAL_JOB)
    borrower = Job.objects.filter(priority="best_effort").order_by("name").first()
    other = Job.objects.filter(priority="best_effort").exclude(pk=borrower.pk).order_by("name").first()
    since = ElasticEvent.objects.order_by("-id").values_list("id", flat=True).first()
    record_event("reclaim", job=borrower, actor="planner", reason={"rule": "harvest.reclaim", "text": "window", "inputs": {}})
    record_event("place", job=other, actor="planner", reason={"rule": "queue", "text": "not a borrower", "inputs": {}})
    director = demo.Director("127.0.0.1", 0, torch_nodes=0, fail_after_s=0, out=io.StringIO())
    monkeypatch.setattr(demo, "WATCH_TIMEOUT_S", 1.5)

    director._resumes(reservation.name, since)  # nothing has completed: waited for, then said
    said = director.out.getvalue()
    assert f"When {demo.STORY_CRITICAL_JOB} finishes" in said and f"{demo.STORY_CRITICAL_JOB} is still running" in said
    assert "no borrower has been placed again yet" in said  # the other job's placement is not a resume

    record_event("complete", job=reservation.job, actor="planner", reason={"rule": "done", "text": "done", "inputs": {}})
    record_event("place", job=borrower, actor="planner", reason={"rule": "queue", "text": "resumed", "inputs": {}})
    director.out = io.StringIO()
    director._resumes(reservation.name, since)
    said = director.out.getvalue()
    assert f"{demo.STORY_CRITICAL_JOB} has finished, so its GPUs are free again" in said
    assert "still running" not in said and "no borrower" not in said
    assert said.count("  -> ") == 2 and "-> resumed" in said and "not a borrower" not in said


def test_an_eager_task_in_embedded_mode_logs_no_broker_warning(db, caplog, django_capture_on_commit_callbacks):
    """Embedded mode runs tasks eagerly, but Celery still takes a producer from its pool, which
    builds a connection to the in-memory broker: that must not warn in the demo's log."""
    import logging

    from kombu import pools

    from jobs.actions._common import trigger_plan
    from omniweb.celery import app

    assert app.conf.task_always_eager
    # The pools are per process: empty them, so this call builds the connection whatever ran first.
    pools.reset()
    app._pool = None
    app.amqp._producer_pool = None
    with caplog.at_level(logging.WARNING):
        with django_capture_on_commit_callbacks(execute=True) as callbacks:
            trigger_plan("test")
    assert callbacks  # the pass ran (it may queue callbacks of its own)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not warnings, warnings
