"""``manage.py demo``: serve the seeded cluster with real node agents and play the live story.

The web server and the planner loop start at once (the login page answers within seconds); a
director thread then issues each node an agent token, starts the agents (real torch workers on
the reserved nodes, simulated ones elsewhere, all speaking the same protocol) and tells the story
in the terminal, one step at a time, each announced before it happens with what to look at on the
Cluster page: a loan (best-effort jobs borrow omni-7b's idle reserved GPUs), a graceful reclaim
(checkpoint first, ahead of its window), a node failure (the director ``kill -9``s one node's agent
after the window has opened) and the recovery, and the borrowers resuming from their checkpoints.
The loan, the reclaim and the recovery are the planner's own doing; the director only watches
the audit log for them and paces its words. docs/control-loop.md.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta
from pathlib import Path

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand
from django.db import close_old_connections, transaction
from django.utils import timezone

from jobs.live_events import describe_event
from jobs.management.commands.seed_demo import DEMO_PASSWORD, DEMO_USERS
from jobs.models import Allocation, ElasticEvent, EventKind, Integration, Job, Node, NodeState, Reservation

ROOT = Path(settings.BASE_DIR)
SEPARATE_SIMULATED_AGENTS = 6
# Pacing: a newcomer reads each announcement, then watches the step happen on the Cluster page.
STEP_GAP_S = 25  # at least this long between two steps
WARNING_S = 15  # an announced step the director makes itself (the failure) happens this long after
RECLAIM_ANNOUNCE_S = 75  # the reclaim is announced this long before the window opens (it starts ~35 s before)
WATCH_TIMEOUT_S = 240  # how long to wait for the planner's part of a step before moving on
STORY_CRITICAL_JOB = "omni-7b"  # seed_demo --story's critical job, whose window the story is about


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def no_agents_because() -> str | None:
    """Why the demo starts no agents on this database (every node failed), or None."""
    if Node.objects.exclude(state=NodeState.FAILED).exists():
        return None
    return ("Every node of this database is failed (an earlier run's agents went silent), so no agents "
            "start and no story plays; `make clean demo` starts afresh (it removes var/).")


def story_played() -> bool:
    """Whether the seeded story's critical job has already run: the loan, the reclaim before its
    window and the borrowers' resume are then behind this database, not ahead of it. False for a
    cluster without the story's job (``seed_demo`` without ``--story``)."""
    return Job.objects.filter(name=STORY_CRITICAL_JOB, first_started_at__isnull=False).exists()


def _torch_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


class Director:
    """Starts the agents and plays the scripted node failure; stops every process it started."""

    def __init__(self, host: str, port: int, torch_nodes: int, fail_after_s: float, out, story: bool = True) -> None:
        self.host = host
        self.port = port
        self.torch_nodes = torch_nodes if _torch_available() else 0
        self.fail_after_s = fail_after_s
        self.story = story  # False: start the agents only (the story has played on this database)
        self.out = out
        self.dir = Path(settings.VAR_DIR) / "demo"
        self.procs: dict[str, subprocess.Popen] = {}
        self._stop = threading.Event()

    def say(self, text: str) -> None:
        self.out.write(f"  [demo {time.strftime('%H:%M:%S')}] {text}\n")
        self.out.flush()

    def step(self, number: int, title: str, text: str) -> None:
        """Announce a step before it happens: what will happen, and where to look."""
        self.out.write("\n")
        self.say(f"Step {number}: {title}. {text}")

    def _pause(self, seconds: float) -> bool:
        """Wait (True when the demo is stopping)."""
        return self._stop.wait(max(0.0, seconds))

    def _watch(self, kind: str, after_id: int, job: str | set[str] | None = None) -> ElasticEvent | None:
        """The first audit row of ``kind`` (of ``job``, or of any of a set of jobs) after
        ``after_id``, polled until it appears."""
        deadline = time.monotonic() + WATCH_TIMEOUT_S
        while not self._pause(1.0):
            rows = ElasticEvent.objects.filter(kind=kind, id__gt=after_id)
            if job:
                rows = rows.filter(job_name=job) if isinstance(job, str) else rows.filter(job_name__in=job)
            row = rows.order_by("id").first()
            close_old_connections()
            if row is not None or time.monotonic() > deadline:
                return row
        return None

    def _report(self, row: ElasticEvent | None, missing: str) -> None:
        self.say(f"  -> {describe_event(row, with_time=False)}" if row is not None else f"  -> {missing}")

    @staticmethod
    def _last_id() -> int:
        last = ElasticEvent.objects.order_by("-id").values_list("id", flat=True).first() or 0
        close_old_connections()
        return last

    @staticmethod
    def _next_window() -> tuple[str, datetime] | None:
        """The soonest reserved window opening in the next 15 minutes: (reservation, start)."""
        now = timezone.now()
        soonest = None
        for reservation in Reservation.objects.filter(cancelled_at__isnull=True):
            start = reservation.next_window_start(now)
            if start is not None and start <= now + timedelta(minutes=15) and (soonest is None or start < soonest[1]):
                soonest = (reservation.name, start)
        close_old_connections()
        return soonest

    def _tokens(self) -> list[tuple[str, str, int]]:
        """A fresh token per node, written to files only this user can read."""
        self.dir.mkdir(parents=True, exist_ok=True)
        out = []
        with transaction.atomic():
            for node in Node.objects.select_for_update(no_key=True).order_by("rack", "switch", "name"):
                token = node.issue_token()
                node.save(update_fields=["agent_token_hash"])
                out.append((node.name, token, node.gpu_count))
        return out

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = (self.dir / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        log.close()

    def _agent_argv(self, name: str, token: str, gpus: int, simulated: bool) -> list[str]:
        token_file = self.dir / f"{name}.token"
        token_file.write_text(token)
        token_file.chmod(0o600)
        argv = [sys.executable, "-m", "trainer_agent.node", "--server", f"http://{self.host}:{self.port}",
                "--token-file", str(token_file), "--node", name, "--simulate-gpus", str(gpus),
                "--runs-dir", str(self.dir / "runs")]
        return argv + (["--simulated-workers", "--time-scale", "0.5"] if simulated else [])

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # the web server keeps serving; say what went wrong
            self.say(f"director stopped: {exc}")
        finally:
            close_old_connections()

    def _run(self) -> None:
        while not _answers(self.host, self.port):
            if self._stop.wait(0.2):
                return
        nodes = self._tokens()
        torch_names = {name for name, _, _ in nodes[: self.torch_nodes]}
        # One process per node for the first few (so any one of them can die alone); a larger
        # seeded cluster's remaining nodes share one process of virtual nodes.
        virtual = []
        for index, (name, token, gpus) in enumerate(nodes):
            if index < len(torch_names) + SEPARATE_SIMULATED_AGENTS:
                self._spawn(f"agent-{name}", self._agent_argv(name, token, gpus, simulated=name not in torch_names))
            else:
                virtual.append({"node": name, "token": token, "gpus": gpus})
        if virtual:
            spec = self.dir / "virtual-nodes.json"
            spec.write_text(json.dumps(virtual))
            spec.chmod(0o600)
            self._spawn("agents-virtual", [
                sys.executable, "-m", "trainer_agent.node", "--server", f"http://{self.host}:{self.port}",
                "--virtual-nodes", str(spec), "--runs-dir", str(self.dir / "runs"), "--time-scale", "0.5",
            ])
        kinds = f"{len(torch_names)} with real torch workers, {len(nodes) - len(torch_names)} simulated"
        self.say(f"started agents for {len(nodes)} nodes ({kinds}); logs in {self.dir}")
        if self.story:
            self._story(nodes, torch_names)

    def _story(self, nodes: list[tuple[str, str, int]], torch_names: set[str]) -> None:
        """The steps, each announced, then watched for in the audit log, at least STEP_GAP_S apart."""
        window = self._next_window()
        mark = self._last_id()
        self.step(1, "a loan", "As the agents connect, the planner places the regular jobs on general GPUs and "
                  "lends the critical job's idle reserved GPUs to best-effort jobs. On the Cluster page: "
                  "teal-striped GPUs on the map, and teal loan bars under the reservation on the timeline.")
        self._report(self._watch(EventKind.LEND, mark), "no loan yet (see the Audit page)")
        stepped = time.monotonic()
        if window is not None:
            name, opens = window
            announce_in = (opens - timezone.now()).total_seconds() - RECLAIM_ANNOUNCE_S
            if self._pause(max(announce_in, STEP_GAP_S - (time.monotonic() - stepped))):
                return
            mark = reclaim_mark = self._last_id()
            at = time.strftime("%H:%M:%S", time.localtime(opens.timestamp()))
            self.step(2, "a graceful reclaim", f"{name}'s window opens at {at}. About half a minute before, the "
                      "planner takes its GPUs back: each borrower saves a checkpoint first (state checkpointing), "
                      "then stops as preempted with no steps lost, its loan bar ends, and the critical job starts "
                      "on its reserved GPUs. The Audit page shows the reclaim and its outcome (checkpoint step, "
                      "save time).")
            self._report(self._watch(EventKind.RECLAIM, mark), "no reclaim yet (see the Audit page)")
            stepped = time.monotonic()
            opens_in = (opens - timezone.now()).total_seconds()
            wait_s = max(opens_in + self.fail_after_s, STEP_GAP_S) - WARNING_S
        else:
            wait_s = max(self.fail_after_s, STEP_GAP_S) - WARNING_S
        if self.fail_after_s <= 0 or self._pause(wait_s):
            return
        victim, job = self._pick_victim(set(self.procs) - {f"agent-{n}" for n in torch_names}) or (None, None)
        if victim is None:
            self.say("no simulated node runs anything; skipping the node failure")
            return
        mark = self._last_id()
        if Job.objects.filter(name=job, integration=Integration.SIGNAL).exists():
            falls = (f"{job}, a plain script in signal mode, starts again from its own last save (Omni sees none; "
                     "this one saves only on SIGTERM, so it starts over)")
            lost = "the time it had run"
        else:
            falls, lost = f"{job} falls back to its last checkpoint", "steps lost"
        self.step(3, "a node fails and its job recovers", f"In {WARNING_S} s the demo kills {victim}'s agent "
                  f"(kill -9). On the Cluster page {victim} turns amber (suspect), then red (failed); {falls} "
                  f"and the planner recovers it on other GPUs. The Audit page shows node_suspect, node_failed "
                  f"({lost}) and recover.")
        if self._pause(WARNING_S):
            return
        proc = self.procs.pop(f"agent-{victim}")
        os.killpg(proc.pid, signal.SIGKILL)
        self.say(f"killed {victim}'s agent")
        self._report(self._watch(EventKind.RECOVER, mark, job), f"{job} has not recovered yet (see the Audit page)")
        if self._pause(max(0.0, 30 - WARNING_S)):
            return
        state = Node.objects.get(name=victim).state
        close_old_connections()
        self.say(f"{victim}'s agent is back; the node stays {state} until an operator marks it repaired "
                 "(Cluster page, signed in as olga: click the node, then Mark repaired)")
        token, gpus = next((t, g) for n, t, g in nodes if n == victim)
        self._spawn(f"agent-{victim}", self._agent_argv(victim, token, gpus, simulated=True))
        if window is None or self._pause(STEP_GAP_S):
            return
        self._resumes(window[0], reclaim_mark)

    def _resumes(self, reservation: str, since: int) -> None:
        """Step 4: the reserved job completes and the borrowers reclaimed for it are placed again.
        Both are watched from the reclaim's mark (``since``), not from this step's: a short
        critical job may have finished while the node failure was played, and that is said."""
        critical = Reservation.objects.filter(name=reservation).values_list("job__name", flat=True).first() or ""
        done = ElasticEvent.objects.filter(kind=EventKind.COMPLETE, id__gt=since, job_name=critical).first()
        close_old_connections()
        resuming = ("the best-effort jobs it preempted are placed again, resuming from exactly the step they saved "
                    "(their job pages: the checkpoints table and the event log).")
        if done is not None:
            self.step(4, "the borrowers resume", f"{critical} has finished, so its GPUs are free again: {resuming}")
        else:
            self.step(4, "the borrowers resume", f"When {critical} finishes, its GPUs are free again and {resuming}")
            done = self._watch(EventKind.COMPLETE, since, critical)
        self._report(done, f"{critical} is still running")
        borrowers = set(ElasticEvent.objects.filter(kind=EventKind.RECLAIM, id__gt=since).values_list("job_name", flat=True))
        close_old_connections()
        placed = self._watch(EventKind.PLACE, since, borrowers or None)
        self._report(placed, "no borrower has been placed again yet")

    def _pick_victim(self, candidates: set[str]) -> tuple[str, str] | None:
        """The simulated node running the most important work, and that job: a regular job if any
        (the critical job's window is the story's reclaim; with --torch-nodes 0 it is a candidate)."""
        rank = {"regular": 0, "critical": 1, "best_effort": 2}
        best: tuple[int, str, str] | None = None
        for alloc in Allocation.objects.select_related("node", "job"):
            if f"agent-{alloc.node.name}" not in candidates:
                continue
            key = (rank.get(alloc.job.priority, 3), alloc.node.name, alloc.job.name)
            best = key if best is None or key < best else best
        close_old_connections()
        return (best[1], best[2]) if best else None

    def start(self) -> None:
        threading.Thread(target=self.run, name="omni-demo-director", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


class Command(BaseCommand):
    help = "Serve the demo: the web UI, the API, the planner loop, node agents and the scripted story."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--no-agents", action="store_true", help="serve only; start no agents")
        parser.add_argument("--torch-nodes", type=int, default=2,
                            help="nodes whose agent runs real torch workers (the rest are simulated)")
        parser.add_argument("--fail-after", type=float, default=30.0,
                            help="seconds after the reserved window opens (after the loan, with no window "
                            "soon) before one node's agent is killed (0: never)")

    def handle(self, *args, host: str, port: int, no_agents: bool, torch_nodes: int, fail_after: float,
               **options) -> None:
        url = f"http://{host}:{port}/"
        self.stdout.write("")
        self.stdout.write(f"  Omni demo: open {url}")
        for name, role, _ in DEMO_USERS:
            self.stdout.write(f"    {name:<8} {role:<11} password {DEMO_PASSWORD}")
        self.stdout.write(f"  API: {url}api/   OpenAPI schema: {url}api/schema/   Admin: {url}admin/")
        self.stdout.write("  The story, over about five minutes, each step announced here before it happens: best-")
        self.stdout.write("  effort jobs borrow omni-7b's idle reserved GPUs, give them back with a checkpoint before")
        self.stdout.write("  its window opens, a node fails and its job recovers elsewhere, and the borrowers resume")
        self.stdout.write("  from their checkpoints. Watch the Cluster page (and the Audit page for the details).")
        self.stdout.write("  Stop with Ctrl-C.")
        self.stdout.write("")
        # The story's lines are what a newcomer reads here: no "task succeeded" line between them.
        logging.getLogger("celery.app.trace").setLevel(logging.WARNING)
        director = None
        blocked = None if no_agents else no_agents_because()
        if blocked:
            self.stdout.write(f"  {blocked}")
        elif not no_agents:
            story = not story_played()
            if not story:
                self.stdout.write(f"  This database has played the story before ({STORY_CRITICAL_JOB} has already run), "
                                  "so its steps would not happen again: the cluster is served as it is, with its "
                                  "agents. For the story from the start, stop (Ctrl-C) and run `make clean demo` (it "
                                  "removes var/: the embedded database and the demo's run dirs).")
            director = Director(host, port, torch_nodes, fail_after, self.stdout, story=story)
            director.start()
        try:
            call_command("serve", host=host, port=port)
        finally:
            if director is not None:
                director.stop()
