"""The agent's log shipper: files in, bounded frames out, nothing lost or doubled across reconnects.

Pure and fast: real files in a tmp dir, and a stand-in for the server that stores a line once by
(rank, stream, offset), as the database's unique constraint does (jobs.actions.logs).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from trainer_agent import protocol
from trainer_agent.logship import LogShipper


class Server:
    """Stores lines by (rank, stream, offset) and acknowledges frames, like jobs.actions.logs."""

    def __init__(self) -> None:
        self.lines: dict[tuple[int, str, int], tuple[str, int]] = {}
        self.received = 0  # lines received, re-sent ones included

    def store(self, frame: dict) -> dict:
        assert frame["type"] == protocol.LOGS
        assert len(protocol.dumps(frame)) <= protocol.MAX_FRAME_BYTES
        for chunk in frame["chunks"]:
            assert len(chunk["lines"]) == len(chunk["sizes"])
            offset = chunk["offset"]
            for text, size in zip(chunk["lines"], chunk["sizes"], strict=True):
                self.lines.setdefault((chunk["rank"], chunk["stream"], offset), (text, size))
                offset += size
                self.received += 1
        return {"type": protocol.LOGS_ACK, "ship": frame["ship"], "job": frame["job"], "run_id": frame["run_id"]}

    def texts(self, rank: int = 0, stream: str = "out") -> list[str]:
        """The stored lines of one file in order, checking that they tile it with no gap."""
        rows = sorted((offset, text, size) for (r, s, offset), (text, size) in self.lines.items()
                      if (r, s) == (rank, stream))
        expected = 0
        for offset, _, size in rows:
            assert offset == expected, f"gap or overlap at {offset} (expected {expected})"
            expected += size
        return [text for _, text, _ in rows]


def pump(shipper: LogShipper, server: Server, rounds: int = 1000) -> int:
    """Send and acknowledge until nothing is left; return the number of frames."""
    sent = 0
    for _ in range(rounds):
        frames = shipper.frames()
        if not frames:
            return sent
        for frame in frames:
            shipper.on_ack(server.store(frame))
        sent += len(frames)
    raise AssertionError("the shipper never ran dry")


def write(path: Path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as handle:
        handle.write(data.encode() if isinstance(data, str) else data)


def file_bytes(frame: dict) -> int:
    return sum(sum(chunk["sizes"]) for chunk in frame["chunks"])


@pytest.fixture
def logs(tmp_path: Path) -> Path:
    return tmp_path / "logs" / "run-1"


def test_lines_arrive_in_file_order_with_their_byte_offsets(logs):
    write(logs / "rank-0.out", "first\nsecond\nthird\n")
    shipper, server = LogShipper(), Server()
    shipper.watch("job-a", "run-1", logs)
    [frame] = shipper.frames()
    assert frame["type"] == "logs" and (frame["job"], frame["run_id"]) == ("job-a", "run-1")
    assert frame["chunks"] == [{"rank": 0, "stream": "out", "offset": 0, "lines": ["first", "second", "third"],
                                "sizes": [6, 7, 6], "at": frame["chunks"][0]["at"]}]
    shipper.on_ack(server.store(frame))
    write(logs / "rank-0.out", "fourth\n")
    [frame] = shipper.frames()
    assert frame["chunks"][0]["offset"] == 19 and frame["chunks"][0]["lines"] == ["fourth"]
    assert frame["ship"] > 1  # every frame its own, increasing id


def test_stdout_and_stderr_of_each_rank_are_separate_chunks(logs):
    write(logs / "rank-0.out", "out line\n")
    write(logs / "rank-0.err", "Traceback (most recent call last):\n")
    write(logs / "rank-1.out", "rank one\n")
    shipper, server = LogShipper(), Server()
    shipper.watch("job-a", "run-1", logs)
    pump(shipper, server)
    assert server.texts(0, "out") == ["out line"]
    assert server.texts(0, "err") == ["Traceback (most recent call last):"]
    assert server.texts(1, "out") == ["rank one"]


def test_a_partial_last_line_waits_for_its_newline(logs):
    write(logs / "rank-0.out", "done\nhalf a li")
    shipper, server = LogShipper(), Server()
    shipper.watch("job-a", "run-1", logs)
    pump(shipper, server)
    assert server.texts() == ["done"]
    assert shipper.frames() == []
    write(logs / "rank-0.out", "ne\n")
    pump(shipper, server)
    assert server.texts() == ["done", "half a line"]


def test_finish_ships_the_last_line_without_its_newline_then_forgets_the_run(logs):
    write(logs / "rank-0.out", "step 1\nexiting without a newline")
    shipper, server = LogShipper(), Server()
    shipper.watch("job-a", "run-1", logs)
    pump(shipper, server)
    assert server.texts() == ["step 1"]
    shipper.finish("job-a", "run-1")
    [frame] = shipper.frames()
    assert frame["chunks"][0]["lines"] == ["exiting without a newline"]
    assert shipper.watching() == [("job-a", "run-1")]  # until the server has it
    shipper.on_ack(server.store(frame))
    assert shipper.watching() == [] and shipper.frames() == [] and shipper.pending_bytes() == 0
    assert server.texts() == ["step 1", "exiting without a newline"]


def test_finish_with_everything_acknowledged_forgets_at_once(logs):
    write(logs / "rank-0.out", "all\n")
    shipper, server = LogShipper(), Server()
    shipper.watch("job-a", "run-1", logs)
    pump(shipper, server)
    shipper.finish("job-a", "run-1")
    assert shipper.watching() == []
    shipper.finish("job-a", "run-1")  # twice, or for a run never watched: nothing happens
    shipper.finish("nobody", "run-x")


def test_unacknowledged_bytes_never_exceed_the_window_and_acks_release_it(logs):
    line = "x" * 99 + "\n"  # 100 bytes
    write(logs / "rank-0.out", line * 10_000)  # 1,000,000 bytes
    shipper, server = LogShipper(window_bytes=8_000, frame_bytes=3_000, max_line_bytes=200), Server()
    shipper.watch("job-a", "run-1", logs)
    frames = shipper.frames()
    assert [file_bytes(f) for f in frames] == [3_000, 3_000, 2_000]
    assert shipper.in_flight_bytes == 8_000
    assert shipper.frames() == []  # back-pressure: nothing more is read until acks arrive
    shipper.on_ack(server.store(frames[0]))
    more = shipper.frames()
    assert [file_bytes(f) for f in more] == [3_000] and shipper.in_flight_bytes == 8_000
    for frame in frames[1:] + more:
        shipper.on_ack(server.store(frame))
    pump(shipper, server)
    assert server.texts() == ["x" * 99] * 10_000
    assert server.received == 10_000  # nothing sent twice without a reconnect


def test_a_reconnect_resends_exactly_the_unacknowledged_lines(logs):
    write(logs / "rank-0.out", "".join(f"line {i}\n" for i in range(50)))
    shipper, server = LogShipper(window_bytes=200, frame_bytes=100, max_line_bytes=20), Server()
    shipper.watch("job-a", "run-1", logs)
    first, *unacked = shipper.frames()
    assert unacked and shipper.in_flight_bytes > 190
    shipper.on_ack(server.store(first))
    lost = [line for frame in unacked for chunk in frame["chunks"] for line in chunk["lines"]]
    shipper.on_disconnect()
    assert shipper.in_flight_bytes == 0
    resent = shipper.frames()
    again = [line for frame in resent for chunk in frame["chunks"] for line in chunk["lines"]]
    assert resent[0]["chunks"][0]["offset"] == unacked[0]["chunks"][0]["offset"]
    assert again[: len(lost)] == lost
    assert resent[0]["ship"] > unacked[-1]["ship"]
    shipper.on_ack({"type": "logs_ack", "ship": unacked[0]["ship"]})  # the old connection's ack: ignored
    assert shipper.in_flight_bytes == sum(file_bytes(f) for f in resent)
    for frame in resent:
        shipper.on_ack(server.store(frame))
    pump(shipper, server)
    assert server.texts() == [f"line {i}" for i in range(50)]


def test_acks_out_of_order_move_a_file_on_only_past_what_is_contiguous(logs):
    write(logs / "rank-0.out", "a" * 9 + "\n" + "b" * 9 + "\n")
    shipper, server = LogShipper(window_bytes=20, frame_bytes=10, max_line_bytes=9), Server()
    shipper.watch("job-a", "run-1", logs)
    first, second = shipper.frames()
    shipper.on_ack(server.store(second))
    shipper.on_disconnect()  # the first was never acknowledged: both are sent again
    resent = shipper.frames()
    assert [c["offset"] for f in resent for c in f["chunks"]] == [0, 10]


def test_long_lines_are_split_without_breaking_a_character(logs):
    text = "é" * 10  # 20 bytes of two-byte characters
    write(logs / "rank-0.out", "abc" + text + "\n")  # 23 bytes + newline
    shipper, server = LogShipper(window_bytes=1000, frame_bytes=100, max_line_bytes=8), Server()
    shipper.watch("job-a", "run-1", logs)
    pump(shipper, server)
    pieces = server.texts()
    assert "".join(pieces) == "abc" + text
    assert "\ufffd" not in "".join(pieces)
    assert all(len(p.encode()) <= 8 for p in pieces) and len(pieces) == 3


def test_a_long_line_still_being_written_ships_its_full_pieces(logs):
    write(logs / "rank-0.out", "y" * 25)  # no newline yet: three pieces of 8 are certain
    shipper, server = LogShipper(window_bytes=1000, frame_bytes=100, max_line_bytes=8), Server()
    shipper.watch("job-a", "run-1", logs)
    pump(shipper, server)
    assert server.texts() == ["y" * 8] * 3
    write(logs / "rank-0.out", "\n")
    pump(shipper, server)
    assert server.texts() == ["y" * 8] * 3 + ["y"]


def test_bad_utf8_is_replaced_and_crlf_line_ends_are_stripped(logs):
    write(logs / "rank-0.out", b"ok\r\n\xff\xfe broken\n")
    shipper, server = LogShipper(), Server()
    shipper.watch("job-a", "run-1", logs)
    pump(shipper, server)
    assert server.texts() == ["ok", "\ufffd\ufffd broken"]


def test_files_appearing_late_are_picked_up(logs):
    shipper, server = LogShipper(), Server()
    shipper.watch("job-a", "run-1", logs)  # the directory does not exist yet
    assert shipper.frames() == []
    write(logs / "rank-0.out", "first rank\n")
    pump(shipper, server)
    write(logs / "rank-3.err", "a late rank\n")
    write(logs / "notes.txt", "not a rank's log\n")
    pump(shipper, server)
    assert server.texts(0, "out") == ["first rank"] and server.texts(3, "err") == ["a late rank"]
    assert {key[:2] for key in server.lines} == {(0, "out"), (3, "err")}


@pytest.mark.parametrize("ranks", [[2, 3], {2, 3}, lambda rank: rank >= 2])
def test_only_the_ranks_of_this_node_are_shipped(logs, ranks):
    for rank in range(4):
        write(logs / f"rank-{rank}.out", f"rank {rank}\n")
    shipper, server = LogShipper(), Server()
    shipper.watch("job-a", "run-1", logs, ranks=ranks)
    pump(shipper, server)
    assert sorted({key[0] for key in server.lines}) == [2, 3]


def test_a_chatty_rank_does_not_starve_the_others(logs):
    write(logs / "rank-0.out", ("z" * 99 + "\n") * 1000)
    write(logs / "rank-1.out", "the quiet rank\n")
    shipper, server = LogShipper(window_bytes=2_000, frame_bytes=1_000, max_line_bytes=200), Server()
    shipper.watch("job-a", "run-1", logs)
    for _ in range(2):  # two rounds of the window, far from the end of rank 0's file
        for frame in shipper.frames():
            shipper.on_ack(server.store(frame))
    assert server.texts(1, "out") == ["the quiet rank"]


def test_runs_are_separate_frames_and_each_is_forgotten_on_its_own(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    write(first / "rank-0.out", "from a\n")
    write(second / "rank-0.out", "from b\n")
    shipper = LogShipper()
    shipper.watch("job-a", "run-1", first)
    shipper.watch("job-b", "run-7", second)
    frames = shipper.frames()
    assert sorted((f["job"], f["run_id"]) for f in frames) == [("job-a", "run-1"), ("job-b", "run-7")]
    shipper.finish("job-a", "run-1")
    for frame in frames:
        shipper.on_ack({"type": "logs_ack", "ship": frame["ship"]})
    assert shipper.watching() == [("job-b", "run-7")]


def test_a_refused_run_is_dropped_and_no_longer_read(logs):
    write(logs / "rank-0.out", "one\n" * 10)
    shipper = LogShipper(window_bytes=20, frame_bytes=10, max_line_bytes=5)
    shipper.watch("job-a", "run-1", logs)
    first, *_ = shipper.frames()
    shipper.on_ack({"type": "logs_ack", "ship": first["ship"], "stored": 0,
                    "refused": "job 'job-a' run 'run-1' is not on this node"})
    assert shipper.watching() == [] and shipper.in_flight_bytes == 0
    assert shipper.frames() == []


def test_pending_bytes_counts_what_the_server_has_not_acknowledged(logs):
    write(logs / "rank-0.out", "12345\n" * 4)
    shipper, server = LogShipper(window_bytes=12, frame_bytes=12, max_line_bytes=5), Server()
    shipper.watch("job-a", "run-1", logs)
    assert shipper.pending_bytes() == 0  # not discovered until the first frames()
    [frame] = shipper.frames()
    assert shipper.pending_bytes() == 24 and shipper.in_flight_bytes == 12
    shipper.on_ack(server.store(frame))
    assert shipper.pending_bytes() == 12


def test_a_frame_holds_at_most_the_protocols_lines(logs, monkeypatch):
    from trainer_agent import logship

    monkeypatch.setattr(logship, "MAX_LOG_LINES_PER_FRAME", 7)
    write(logs / "rank-0.out", "\n" * 20)
    write(logs / "rank-1.out", "\n" * 20)
    shipper, server = LogShipper(), Server()
    shipper.watch("job-a", "run-1", logs)
    frames = shipper.frames()
    assert all(sum(len(c["lines"]) for c in f["chunks"]) <= 7 for f in frames)
    for frame in frames:
        shipper.on_ack(server.store(frame))
    pump(shipper, server)
    assert server.texts(0) == [""] * 20 and server.texts(1) == [""] * 20


# Every byte escaped in JSON (\u0000, \ufffd), or a line per byte.
@pytest.mark.parametrize("data", [b"\x00" * (1 << 20), b"\xff" * (1 << 20), b"\x01\n" * (1 << 19), b"\n" * (1 << 20)])
def test_the_worst_frame_fits_the_protocols_frame_size(logs, data):
    write(logs / "rank-0.out", data)
    shipper = LogShipper(window_bytes=protocol.MAX_LOG_FRAME_BYTES, frame_bytes=protocol.MAX_LOG_FRAME_BYTES,
                         max_line_bytes=protocol.MAX_LOG_LINE_BYTES - 1)
    shipper.watch("job-a", "run-1", logs)
    frames = shipper.frames()
    frame = frames[0]
    lines = sum(len(c["lines"]) for c in frame["chunks"])
    assert file_bytes(frame) > protocol.MAX_LOG_FRAME_BYTES - protocol.MAX_LOG_LINE_BYTES or \
        lines == protocol.MAX_LOG_LINES_PER_FRAME
    for frame in frames:
        assert len(protocol.dumps(frame)) < protocol.MAX_FRAME_BYTES
        json.loads(protocol.dumps(frame))


@pytest.mark.parametrize("kwargs", [
    {"max_line_bytes": 2}, {"max_line_bytes": protocol.MAX_LOG_LINE_BYTES},
    {"frame_bytes": 4096, "max_line_bytes": 4096}, {"frame_bytes": protocol.MAX_LOG_FRAME_BYTES + 1},
    {"window_bytes": 1000, "frame_bytes": 2000, "max_line_bytes": 100},
])
def test_sizes_that_cannot_work_are_refused_at_construction(kwargs):
    with pytest.raises(ValueError):
        LogShipper(**kwargs)


def test_random_writes_acks_and_reconnects_lose_and_double_nothing(logs):
    rng = random.Random(7)
    shipper, server = LogShipper(window_bytes=600, frame_bytes=300, max_line_bytes=64), Server()
    shipper.watch("job-a", "run-1", logs, ranks=[0, 1])
    written: dict[int, list[str]] = {0: [], 1: []}
    unacked: list[dict] = []
    for _ in range(400):
        move = rng.random()
        if move < 0.4:
            rank = rng.choice([0, 1])
            lines = ["".join(rng.choice("abcdé ") for _ in range(rng.randint(0, 40))) for _ in range(rng.randint(1, 5))]
            written[rank] += lines
            write(logs / f"rank-{rank}.out", "".join(line + "\n" for line in lines))
        elif move < 0.7:
            unacked += shipper.frames()
            assert shipper.in_flight_bytes <= 600
        elif move < 0.95 and unacked:
            shipper.on_ack(server.store(unacked.pop(0)))  # the server answers in order
        else:
            if unacked and rng.random() < 0.5:
                server.store(unacked[0])  # stored, but the ack is lost with the connection
            unacked.clear()
            shipper.on_disconnect()
    for frame in unacked:
        shipper.on_ack(server.store(frame))
    shipper.finish("job-a", "run-1")
    pump(shipper, server)
    assert shipper.watching() == []
    for rank in (0, 1):
        assert "".join(server.texts(rank)) == "".join(written[rank])
        stored = sum(size for (r, _, _), (_, size) in server.lines.items() if r == rank)
        assert stored == (logs / f"rank-{rank}.out").stat().st_size
