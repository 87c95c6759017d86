"""``manage.py demo``: serve the seeded cluster with real node agents and play the live story.

The web server and the planner loop start at once (the login page answers within seconds); a
director thread then issues each node an agent token, starts the agents (real torch workers on
the reserved nodes, simulated ones elsewhere, all speaking the same protocol), and a minute in
``kill -9``s one node's agent so its job recovers elsewhere. The rest is the planner's own doing:
best-effort jobs borrow omni-7b's idle reserved GPUs, are preempted with a checkpoint ahead of
its window, and resume from their checkpoints once the GPUs are free again. docs/control-loop.md.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand
from django.db import close_old_connections, transaction

from jobs.management.commands.seed_demo import DEMO_PASSWORD, DEMO_USERS
from jobs.models import Node, NodeState

ROOT = Path(settings.BASE_DIR)
SEPARATE_SIMULATED_AGENTS = 6


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _torch_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


class Director:
    """Starts the agents and plays the scripted node failure; stops every process it started."""

    def __init__(self, host: str, port: int, torch_nodes: int, fail_after_s: float, out) -> None:
        self.host = host
        self.port = port
        self.torch_nodes = torch_nodes if _torch_available() else 0
        self.fail_after_s = fail_after_s
        self.out = out
        self.dir = Path(settings.VAR_DIR) / "demo"
        self.procs: dict[str, subprocess.Popen] = {}
        self._stop = threading.Event()

    def say(self, text: str) -> None:
        self.out.write(f"  [demo {time.strftime('%H:%M:%S')}] {text}\n")
        self.out.flush()

    def _tokens(self) -> list[tuple[str, str, int]]:
        """A fresh token per node, written to files only this user can read."""
        self.dir.mkdir(parents=True, exist_ok=True)
        out = []
        with transaction.atomic():
            for node in Node.objects.select_for_update().order_by("rack", "switch", "name"):
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
        if self.fail_after_s <= 0 or self._stop.wait(self.fail_after_s):
            return
        victim = self._pick_victim(set(self.procs) - {f"agent-{n}" for n in torch_names})
        if victim is None:
            self.say("no simulated node runs anything; skipping the node failure")
            return
        self.say(f"kill -9 the agent of {victim}: watch it go suspect, then failed, and its job recover elsewhere")
        proc = self.procs.pop(f"agent-{victim}")
        os.killpg(proc.pid, signal.SIGKILL)
        if self._stop.wait(30):
            return
        state = Node.objects.get(name=victim).state
        close_old_connections()
        self.say(f"{victim}'s agent is back; the node stays {state} until an operator marks it repaired "
                 "(console: nodes)")
        token, gpus = next((t, g) for n, t, g in nodes if n == victim)
        self._spawn(f"agent-{victim}", self._agent_argv(victim, token, gpus, simulated=True))

    def _pick_victim(self, candidates: set[str]) -> str | None:
        """The simulated node running the most important work (a regular job if any)."""
        from jobs.models import Allocation

        rank = {"critical": 0, "regular": 1, "best_effort": 2}
        best: tuple[int, str] | None = None
        for alloc in Allocation.objects.select_related("node", "job"):
            if f"agent-{alloc.node.name}" not in candidates:
                continue
            key = (rank.get(alloc.job.priority, 3), alloc.node.name)
            best = key if best is None or key < best else best
        close_old_connections()
        return best[1] if best else None

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
        parser.add_argument("--fail-after", type=float, default=60.0,
                            help="seconds before one node's agent is killed (0: never)")

    def handle(self, *args, host: str, port: int, no_agents: bool, torch_nodes: int, fail_after: float,
               **options) -> None:
        url = f"http://{host}:{port}/"
        self.stdout.write("")
        self.stdout.write(f"  Omni demo: open {url}")
        for name, role, _ in DEMO_USERS:
            self.stdout.write(f"    {name:<8} {role:<11} password {DEMO_PASSWORD}")
        self.stdout.write(f"  API: {url}api/   OpenAPI schema: {url}api/schema/   Admin: {url}admin/")
        self.stdout.write("  The story: best-effort jobs borrow omni-7b's reserved GPUs, are preempted with a")
        self.stdout.write("  checkpoint before its window opens, a node fails and its job recovers elsewhere, the")
        self.stdout.write("  borrowers resume from their checkpoints. Follow it on the audit page.")
        self.stdout.write("  Stop with Ctrl-C.")
        self.stdout.write("")
        director = None
        healthy = Node.objects.exclude(state=NodeState.FAILED).exists()
        if not no_agents and healthy:
            director = Director(host, port, torch_nodes, fail_after, self.stdout)
            director.start()
        try:
            call_command("serve", host=host, port=port)
        finally:
            if director is not None:
                director.stop()
