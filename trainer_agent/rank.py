"""One rank of a job, as torchrun starts it: ``python -m trainer_agent.rank -- ARGV...``.

torchrun (``torch.distributed.run --no-python``) runs this once per GPU with the rank's
environment; it runs the researcher's ``ARGV`` as a child and stays beside it to do what the
node agent needs and torchrun does not:

- **registry**: ``{run state}/rank-{RANK}.json`` says which pid on which node runs the rank, so
  the agent can signal the ranks (torchrun starts each in its own session) and check that
  none outlives the job;
- **signals**: SIGTERM and SIGUSR1 sent to this process are passed to the child (the rank's own
  handler decides what to do: checkpoint and exit, or die); SIGKILL of this process group ends
  both. The child dies with this process (``PR_SET_PDEATHSIG``), and this process dies with
  torchrun, so no rank outlives its node's torchrun;
- **logs**: the child's stdout and stderr go to ``{logs}/rank-{RANK}.out`` and ``.err``, each
  capped at ``OMNI_LOG_CAP_BYTES``; past the cap one notice line is written and the last
  ``TAIL_LINES`` lines are kept in memory and appended when the rank ends, so a crash's
  traceback is never lost to the cap;
- **exit**: ``{run state}/rank-{RANK}.exit.json`` with the exit code (or signal) and the time,
  from which the agent names the rank that failed first;
- **a stop asked for**: when the agent stops the run it first writes ``{run state}/stop-asked``
  (``STOP_ASKED``). A rank that then dies of the SIGTERM it was sent did what was asked: the
  exit record keeps the signal (``"asked": true``) but torchrun is told 0. A script may die of
  SIGTERM by design (no handler), or by a race: Python resets its handlers in the teardown of a
  rank already leaving at the step its peers agreed on, and a SIGTERM landing then kills it. Told
  "failed", that node's torchrun would skip its exit barrier and leave the other nodes' torchruns
  waiting in theirs until the grace ran out and they were killed: a clean stop reported as a kill.

The working directory, the argv resolution (``x.py`` and ``-m MODULE`` run with the node's
Python) and the environment are the agent's (trainer_agent/launch.py).
"""

from __future__ import annotations

import collections
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO

TAIL_LINES = 200
DEFAULT_LOG_CAP_BYTES = 64 << 20
FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
STOP_ASKED = "stop-asked"  # in the run's state dir: the agent asked this run to stop


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _die_with(parent: int) -> None:
    """In the child, before exec: die with this wrapper, and not start if it is already gone."""
    _die_with_parent()
    if os.getppid() != parent:
        os._exit(1)


def _parent_is_torchrun() -> bool:
    """Whether the process that started this one is still torchrun. A torchrun killed between
    starting this process and ``_die_with_parent`` would leave it orphaned, with no one to
    signal it: then it must not start the rank at all."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as fh:
            argv = fh.read().split(b"\0")
    except OSError:
        return False
    return any(part in (b"torch.distributed.run", b"torchrun") or part.endswith(b"/torchrun") for part in argv)


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, path)


class CappedLog:
    """Copies one stream of the child to a file, at most ``cap`` bytes, then only a tail."""

    def __init__(self, source: BinaryIO, path: Path, cap: int) -> None:
        self.source = source
        self.path = path
        self.cap = cap
        self.written = 0
        self.dropped = 0
        self.tail: collections.deque[bytes] = collections.deque(maxlen=TAIL_LINES)
        self.thread = threading.Thread(target=self._copy, daemon=True)

    def _copy(self) -> None:
        with self.path.open("ab", buffering=0) as out:
            for line in iter(self.source.readline, b""):
                if self.written + len(line) <= self.cap:
                    out.write(line)
                    self.written += len(line)
                    continue
                if not self.dropped:
                    out.write(f"[omni: log capped at {self.cap} bytes; further output dropped]\n".encode())
                self.dropped += len(line)
                self.tail.append(line)
            if self.dropped:
                out.write(f"[omni: {self.dropped} bytes dropped; the last {len(self.tail)} lines follow]\n".encode())
                for line in self.tail:
                    out.write(line)
                if self.tail and not self.tail[-1].endswith(b"\n"):
                    out.write(b"\n")


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("rank: error: no command to run (usage: python -m trainer_agent.rank -- ARGV...)", file=sys.stderr)
        return 2
    _die_with_parent()
    if os.environ.get("OMNI_RANK_REQUIRE_TORCHRUN", "1") == "1" and not _parent_is_torchrun():
        print("rank: error: not started by torchrun, or torchrun is gone; not starting the rank", file=sys.stderr)
        return 3
    rank = int(os.environ.get("RANK", "0"))
    state = Path(os.environ.get("OMNI_RANK_STATE_DIR") or ".")
    logs = Path(os.environ.get("OMNI_LOG_DIR") or ".")
    state.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    cap = int(os.environ.get("OMNI_LOG_CAP_BYTES") or DEFAULT_LOG_CAP_BYTES)

    child: subprocess.Popen[bytes] | None = None
    pending: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if child is not None and child.poll() is None:
            child.send_signal(signum)
        else:
            pending.append(signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    try:
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                 preexec_fn=functools.partial(_die_with, os.getpid()))
    except OSError as exc:
        message = f"rank {rank}: cannot start {argv[0]!r}: {exc.strerror or exc}\n"
        with (logs / f"rank-{rank}.err").open("ab") as err:
            err.write(message.encode())
        write_json_atomic(state / f"rank-{rank}.exit.json", {"rank": rank, "code": 127, "signal": None,
                                                              "at": time.time(), "error": message.strip()})
        return 127
    write_json_atomic(state / f"rank-{rank}.json", {
        "rank": rank, "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "node": os.environ.get("OMNI_NODE", ""),
        "pid": os.getpid(), "child": child.pid, "started_at": time.time(),
    })
    for signum in pending:
        child.send_signal(signum)
    copiers = [CappedLog(child.stdout, logs / f"rank-{rank}.out", cap),
               CappedLog(child.stderr, logs / f"rank-{rank}.err", cap)]
    for copier in copiers:
        copier.thread.start()
    while True:
        try:
            code = child.wait()
            break
        except InterruptedError:  # pragma: no cover - PEP 475 retries; kept for clarity
            continue
    for copier in copiers:
        copier.thread.join(timeout=10)
    by_signal = -code if code < 0 else None
    record = {"rank": rank, "code": code if code >= 0 else 128 + by_signal, "signal": by_signal, "at": time.time()}
    if by_signal == signal.SIGTERM and (state / STOP_ASKED).exists():
        record["asked"] = True  # it stopped as the agent asked (see the module docstring)
    write_json_atomic(state / f"rank-{rank}.exit.json", record)
    return 0 if record.get("asked") else record["code"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
