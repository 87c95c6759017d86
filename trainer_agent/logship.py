"""Ship the ranks' log files to the control plane: bounded, back-pressured, nothing lost (docs/logs.md).

Each rank writes its stdout and stderr to ``{log_dir}/rank-{RANK}.out`` / ``.err``
(trainer_agent/rank.py); the files only grow. :class:`LogShipper` tails them and cuts what is
new into ``logs`` frames (``trainer_agent.protocol``). **The files are the buffer**: the shipper
keeps only offsets, never a copy of the log. Per file it remembers how far the server has
acknowledged (``acked``) and how far frames have been sent (``sent``); at most ``window_bytes``
are sent and unacknowledged at any time, so a slow server makes the shipper stop reading, never
the ranks stop writing. A reconnect rewinds every file to its acknowledged offset and sends the
rest again; the server stores a line once by its (run, rank, stream, offset), so nothing is lost
and nothing is stored twice.

Only complete lines are sent; a partial last line waits for its newline, except after
:meth:`LogShipper.finish` (the run ended). Lines longer than ``max_line_bytes`` are split, on a
UTF-8 character boundary. Text is decoded as UTF-8 with ``errors="replace"``.

How the node agent drives it, all from one thread: ``watch`` when a run starts, ``frames()``
while the socket is up (send each), ``on_ack`` for each ``logs_ack``, ``on_disconnect`` when the
socket drops, ``finish`` when the run's ranks have exited. Pure Python, no Django.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer_agent.protocol import (
    LOGS,
    MAX_LOG_FRAME_BYTES,
    MAX_LOG_LINE_BYTES,
    MAX_LOG_LINES_PER_FRAME,
)

logger = logging.getLogger("trainer_agent.logship")

LOG_FILE = re.compile(r"^rank-(\d+)\.(out|err)$")
STREAMS = ("out", "err")

RankFilter = Iterable[int] | Callable[[int], bool] | None


@dataclass
class _Segment:
    """Bytes [start, end) of one file, sent in one frame; ``acked`` once the server stored them."""

    start: int
    end: int
    acked: bool = False


@dataclass
class _File:
    rank: int
    stream: str
    path: Path
    acked: int = 0  # the server has stored every line before this offset
    sent: int = 0  # every line before this offset is in a frame sent on this connection
    limit: int | None = None  # after finish: the file's size when the run ended
    inflight: deque[_Segment] = field(default_factory=deque)

    def size(self) -> int:
        try:
            size = self.path.stat().st_size
        except OSError:  # not there (yet, or any more): nothing to read
            return self.acked
        return size if self.limit is None else min(size, self.limit)


@dataclass
class _Run:
    job: str
    run_id: str
    log_dir: Path
    wants: Callable[[int], bool]
    files: dict[tuple[int, str], _File] = field(default_factory=dict)
    finished: bool = False
    turn: int = 0  # which file starts the next frame, so one chatty rank cannot starve the others

    @property
    def key(self) -> tuple[str, str]:
        return self.job, self.run_id


@dataclass
class _Shipment:
    """A frame sent and not yet acknowledged."""

    run: tuple[str, str]
    parts: list[tuple[_File, _Segment]]
    size: int


def _rank_filter(ranks: RankFilter) -> Callable[[int], bool]:
    if ranks is None:
        return lambda rank: True
    if callable(ranks):
        return ranks
    wanted = frozenset(int(r) for r in ranks)
    return wanted.__contains__


def _utf8_cut(data: bytes, start: int, end: int) -> int:
    """``end`` moved back (at most 3 bytes) so that it does not split a UTF-8 character."""
    cut = end
    while cut > start + 1 and end - cut < 3 and (data[cut] & 0xC0) == 0x80:
        cut -= 1
    return cut if (data[cut] & 0xC0) != 0x80 else end


class LogShipper:
    """Tails rank log files and makes bounded ``logs`` frames; see the module's docstring.

    ``window_bytes``: the most file bytes sent and not yet acknowledged. ``frame_bytes``: the most
    file bytes in one frame. ``max_line_bytes``: longer lines are split into pieces of this size.
    Sizes are bytes of the files (a line counts its newline).
    """

    def __init__(self, window_bytes: int = 256 * 1024, frame_bytes: int = 64 * 1024,
                 max_line_bytes: int = 4096) -> None:
        if max_line_bytes < 4 or max_line_bytes + 1 > MAX_LOG_LINE_BYTES:
            raise ValueError(f"max_line_bytes must be within 4..{MAX_LOG_LINE_BYTES - 1}, got {max_line_bytes}")
        if not max_line_bytes < frame_bytes <= MAX_LOG_FRAME_BYTES:
            raise ValueError(f"frame_bytes must exceed max_line_bytes ({max_line_bytes}) and be at most "
                             f"{MAX_LOG_FRAME_BYTES}, got {frame_bytes}")
        if window_bytes < frame_bytes:
            raise ValueError(f"window_bytes ({window_bytes}) must be at least frame_bytes ({frame_bytes})")
        self.window_bytes = window_bytes
        self.frame_bytes = frame_bytes
        self.max_line_bytes = max_line_bytes
        self._runs: dict[tuple[str, str], _Run] = {}
        self._shipments: dict[int, _Shipment] = {}
        self._ship_ids = itertools.count(1)
        self._turn = 0  # which run starts the next call, for the same reason as _Run.turn
        self.in_flight_bytes = 0

    # -- what the agent tells it -------------------------------------------------------------------

    def watch(self, job: str, run_id: str, log_dir: Path, ranks: RankFilter = None) -> None:
        """Start tailing ``rank-N.out``/``.err`` in ``log_dir``: the given ranks (a collection or
        a predicate), else every rank file that appears. Watching a run again changes its ranks."""
        run = self._runs.get((job, run_id))
        if run is None:
            self._runs[(job, run_id)] = _Run(job, run_id, Path(log_dir), _rank_filter(ranks))
        else:
            run.log_dir, run.wants = Path(log_dir), _rank_filter(ranks)

    def finish(self, job: str, run_id: str) -> None:
        """The run ended: ship what remains, a last line without its newline too, then forget the
        run once the server has acknowledged all of it."""
        run = self._runs.get((job, run_id))
        if run is None or run.finished:
            return
        self._discover(run)
        run.finished = True
        for file in run.files.values():
            file.limit = file.size()
        self._forget_if_done(run)

    def on_ack(self, frame: dict[str, Any]) -> None:
        """A ``logs_ack``: the frame ``ship`` is stored; its files' acknowledged offsets move on.
        With ``refused`` the server does not want this run's lines at all: the run is forgotten."""
        shipment = self._shipments.pop(frame.get("ship"), None)  # type: ignore[arg-type]
        if shipment is None:
            return  # an ack from before a reconnect: those lines are being sent again
        self.in_flight_bytes -= shipment.size
        for file, segment in shipment.parts:
            segment.acked = True
            while file.inflight and file.inflight[0].acked:
                file.acked = file.inflight.popleft().end
        run = self._runs.get(shipment.run)
        if run is None:
            return
        if frame.get("refused"):
            logger.warning("the server refused the logs of %s run %s: %s", run.job, run.run_id, frame["refused"])
            self._drop(run)
            return
        self._forget_if_done(run)

    def on_disconnect(self) -> None:
        """The socket dropped: everything sent and not acknowledged is sent again from the last
        acknowledged offsets (acks of the old connection are ignored: new frames, new ids)."""
        self._shipments.clear()
        self.in_flight_bytes = 0
        for run in self._runs.values():
            for file in run.files.values():
                file.sent = file.acked
                file.inflight.clear()

    # -- what it gives the agent ---------------------------------------------------------------------

    def frames(self) -> list[dict[str, Any]]:
        """The frames to send now (each at most ``frame_bytes``, all of them within the window)."""
        out: list[dict[str, Any]] = []
        runs = list(self._runs.values())
        if not runs:
            return out
        start = self._turn % len(runs)
        self._turn += 1
        for run in runs[start:] + runs[:start]:
            if not run.finished:
                self._discover(run)
            while self.window_bytes - self.in_flight_bytes > 0:
                frame = self._frame(run, min(self.frame_bytes, self.window_bytes - self.in_flight_bytes))
                if frame is None:
                    break
                out.append(frame)
            self._forget_if_done(run)
        return out

    def pending_bytes(self) -> int:
        """Bytes in the watched files that the server has not acknowledged yet (sent or not)."""
        return sum(max(0, file.size() - file.acked) for run in self._runs.values() for file in run.files.values())

    def watching(self) -> list[tuple[str, str]]:
        """The (job, run id) pairs still watched: finished runs leave once fully acknowledged."""
        return list(self._runs)

    # -- inside --------------------------------------------------------------------------------------

    def _discover(self, run: _Run) -> None:
        try:
            entries = os.listdir(run.log_dir)
        except OSError:  # the directory appears when the first rank starts
            return
        for name in entries:
            match = LOG_FILE.match(name)
            if match is None:
                continue
            rank, stream = int(match.group(1)), match.group(2)
            if (rank, stream) not in run.files and run.wants(rank):
                run.files[(rank, stream)] = _File(rank, stream, run.log_dir / name)

    def _frame(self, run: _Run, budget: int) -> dict[str, Any] | None:
        files = sorted(run.files.values(), key=lambda f: (f.rank, STREAMS.index(f.stream)))
        if not files:
            return None
        start = run.turn % len(files)
        run.turn += 1
        chunks: list[dict[str, Any]] = []
        parts: list[tuple[_File, _Segment]] = []
        size = lines = 0
        for file in files[start:] + files[:start]:
            chunk = self._chunk(file, budget - size, MAX_LOG_LINES_PER_FRAME - lines, run.finished)
            if chunk is None:
                continue
            segment = _Segment(file.sent, file.sent + chunk["bytes"])
            file.sent = segment.end
            file.inflight.append(segment)
            parts.append((file, segment))
            size += chunk.pop("bytes")
            lines += len(chunk["lines"])
            chunks.append(chunk)
        if not chunks:
            return None
        ship = next(self._ship_ids)
        self._shipments[ship] = _Shipment(run.key, parts, size)
        self.in_flight_bytes += size
        return {"type": LOGS, "job": run.job, "run_id": run.run_id, "ship": ship, "chunks": chunks}

    def _chunk(self, file: _File, budget: int, max_lines: int, final: bool) -> dict[str, Any] | None:
        """The next lines of ``file`` that fit in ``budget`` bytes, or None."""
        available = file.size() - file.sent
        if available <= 0 or budget <= 0 or max_lines <= 0:
            return None
        want = min(budget, available)
        try:
            with file.path.open("rb") as handle:
                handle.seek(file.sent)
                data = handle.read(want)
        except OSError as exc:
            logger.warning("cannot read %s: %s", file.path, exc)
            return None
        to_end = len(data) == available  # everything the file holds (up to its limit) was read
        texts: list[str] = []
        sizes: list[int] = []
        pos = 0
        while pos < len(data) and len(texts) < max_lines:
            newline = data.find(b"\n", pos, pos + self.max_line_bytes + 1)
            if newline != -1:
                end, content = newline + 1, data[pos:newline]
                if content.endswith(b"\r"):
                    content = content[:-1]
            elif len(data) - pos > self.max_line_bytes:  # a long line: its next piece
                end = _utf8_cut(data, pos, pos + self.max_line_bytes)
                content = data[pos:end]
            elif final and to_end:  # the run ended: its last line has no newline
                end, content = len(data), data[pos:]
            else:
                break  # a partial line waits for its newline (or for a frame with room)
            texts.append(content.decode("utf-8", errors="replace"))
            sizes.append(end - pos)
            pos = end
        if not texts:
            return None
        return {"rank": file.rank, "stream": file.stream, "offset": file.sent, "lines": texts, "sizes": sizes,
                "at": round(time.time(), 3), "bytes": pos}

    def _forget_if_done(self, run: _Run) -> None:
        if run.finished and all(not f.inflight and f.acked >= f.size() for f in run.files.values()):
            self._runs.pop(run.key, None)

    def _drop(self, run: _Run) -> None:
        for ship, shipment in list(self._shipments.items()):
            if shipment.run == run.key:
                del self._shipments[ship]
                self.in_flight_bytes -= shipment.size
        self._runs.pop(run.key, None)
