"""The node agent on its own (no server, no torch): duplicate commands are acknowledged again but
applied once, a preempt ends in a checkpoint and a done with its step, and the record buffer
drops its oldest records with a count when the server is away too long."""

from __future__ import annotations

import asyncio
import json
import signal

from trainer_agent import node as agent_node
from trainer_agent import workers
from trainer_agent.node import GpuInventory, NodeAgent


def _agent(tmp_path) -> NodeAgent:
    return NodeAgent("http://127.0.0.1:9", "token", node="n1", gpus=GpuInventory(2), runs_dir=tmp_path,
                     simulated_workers=True, time_scale=0.05)


def _payload(**overrides):
    payload = {"job": "be", "leader": True, "gpus": [0], "dp": 1, "total_steps": 10000, "checkpoint_every": 3,
               "step_s": 1.0, "global_batch": 16, "micro_batch": 2, "accum": 8}
    payload.update(overrides)
    return payload


async def _command(agent: NodeAgent, command_id: str, kind: str, payload: dict, job: str = "be") -> None:
    """Hand the agent one command frame, as the server's socket does."""
    await agent.on_command({"type": "command", "id": command_id, "kind": kind, "job": job, "payload": payload})


def _done_of(agent: NodeAgent, command_id: str) -> dict:
    """The one ``done`` the agent queued for ``command_id``."""
    (done,) = [f for f in agent.control_out if f["type"] == "done" and f["command"] == command_id]
    return done


def test_a_repeated_command_is_acknowledged_again_but_applied_once(tmp_path):
    async def scenario():
        agent = _agent(tmp_path)
        frame = {"type": "command", "id": "c-1", "kind": "start", "job": "be", "payload": _payload()}
        await agent.on_command(frame)
        first_worker = agent.jobs["be"]
        await agent.on_command(frame)
        assert agent.jobs["be"] is first_worker
        sent = list(agent.control_out)
        assert [f["type"] for f in sent] == ["ack", "done", "ack", "done"]
        assert sent[1] == sent[3]  # the cached outcome, re-sent
        first_worker.signal(signal.SIGKILL)

    asyncio.run(scenario())


def test_a_preempt_finishes_the_step_saves_and_reports_the_checkpoint(tmp_path):
    async def scenario():
        agent = _agent(tmp_path)
        supervisor = asyncio.create_task(agent._supervise())
        await _command(agent, "s", "start", _payload())
        for _ in range(100):
            await asyncio.sleep(0.05)
            if agent.jobs["be"].handle.step >= 4:
                break
        await _command(agent, "p", "preempt", _payload())  # no deadline: the stop waits for the save
        for _ in range(100):
            await asyncio.sleep(0.05)
            if "be" not in agent.jobs:
                break
        supervisor.cancel()
        done = _done_of(agent, "p")
        assert done["ok"] is True
        step = done["outcome"]["checkpoint_step"]
        assert step >= 4 and step == workers.newest_checkpoint_on_disk(tmp_path / "be")

    asyncio.run(scenario())


class _Socket:
    """A server connection as the agent sees it: a welcome, then whatever the agent sends, then
    closed (the server side died, or the connection was cut)."""

    local_address = ("127.0.0.1", 1)

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.fail = False  # the next send raises, like a socket closed under it

    async def recv(self) -> str:
        return json.dumps({"type": "welcome", "protocol": 1, "node": "n1", "heartbeat_interval_s": 1.0})

    async def send(self, text: str) -> None:
        if self.fail:
            raise ConnectionError("socket closed")
        self.sent.append(json.loads(text))

    def steps(self) -> list[tuple[int, list[int]]]:
        return [(f["seq"], [r["step"] for r in f["records"]]) for f in self.sent if f["type"] == "steps"]

    def __aiter__(self):
        return self

    async def __anext__(self) -> str:
        raise StopAsyncIteration


def test_an_exit_the_socket_took_is_sent_again_after_the_next_hello_until_the_job_runs_again(tmp_path):
    """A completed job's ``exit`` went out on a socket whose server side then died with it
    (PostgreSQL restarting under the consumer): the agent must say it again after it reconnects,
    or the job stays running with no step for ever (bench.faults, docs/faults.md)."""

    async def scenario():
        agent = _agent(tmp_path)
        supervisor = asyncio.create_task(agent._supervise())
        await _command(agent, "s", "start", _payload(total_steps=4, run_id="be-1"))
        for _ in range(200):
            await asyncio.sleep(0.05)
            if "be" not in agent.jobs:
                break
        supervisor.cancel()
        assert "be" not in agent.jobs
        lost = _Socket()
        await agent._session(lost)
        exits = [f for f in lost.sent if f["type"] == "exit"]
        assert [f["outcome"]["outcome"] for f in exits] == ["completed"]

        again = _Socket()
        await agent._session(again)
        types = [f["type"] for f in again.sent]
        assert types[0] == "hello" and "exit" in types, types
        (resent,) = [f for f in again.sent if f["type"] == "exit"]
        assert resent == exits[0]

        # A new run of the job here: its old exit is history and is not sent any more.
        await _command(agent, "r", "resume", _payload(total_steps=400, run_id="be-2"))
        later = _Socket()
        await agent._session(later)
        assert not [f for f in later.sent if f["type"] == "exit"]
        agent.jobs["be"].signal(signal.SIGKILL)

    asyncio.run(scenario())


def test_a_launch_right_behind_the_stop_that_killed_the_old_run_starts_the_new_run(tmp_path):
    """A fencing stop and the new run's resume in one replay: the killed simulated run is not
    still "running", so the resume launches, or the job would run nowhere with its launch done."""

    async def scenario():
        agent = _agent(tmp_path)
        supervisor = asyncio.create_task(agent._supervise())
        await _command(agent, "s", "start", _payload(run_id="be-1"))
        await asyncio.sleep(0.3)
        await _command(agent, "k", "stop", {"job": "be", "leader": False, "kill": True})
        await _command(agent, "r", "resume", _payload(run_id="be-2"))
        done = _done_of(agent, "r")
        assert done["ok"] is True and done["outcome"]["outcome"] == "launched", done
        await asyncio.sleep(0.3)
        assert agent.jobs["be"].alive() and agent.jobs["be"].handle.run_id == "be-2"
        supervisor.cancel()
        agent.jobs["be"].signal(signal.SIGKILL)

    asyncio.run(scenario())


def test_a_launch_of_a_new_run_replaces_a_simulated_old_run_still_playing_here(tmp_path):
    """A resume of run be-2 where the simulated workers of run be-1 still play (no stop reached
    them: the run's lead had moved to another node) kills them and launches be-2. It was
    answered "already running", so the job ran nowhere and made no step while the server held it
    running (bench.faults, seed 64203072)."""

    async def scenario():
        agent = _agent(tmp_path)
        supervisor = asyncio.create_task(agent._supervise())
        await _command(agent, "s", "start", _payload(run_id="be-1"))
        await asyncio.sleep(0.3)
        old = agent.jobs["be"]
        await _command(agent, "r", "resume", _payload(run_id="be-2"))
        done = _done_of(agent, "r")
        assert done["ok"] is True and done["outcome"]["outcome"] == "launched", done
        await asyncio.sleep(0.3)
        assert not old.alive() and agent.jobs["be"].alive() and agent.jobs["be"].handle.run_id == "be-2"
        # The same run again is a repeat, not a new launch.
        await _command(agent, "r2", "resume", _payload(run_id="be-2"))
        again = _done_of(agent, "r2")
        assert again["outcome"]["outcome"] == "already running"
        supervisor.cancel()
        agent.jobs["be"].signal(signal.SIGKILL)

    asyncio.run(scenario())


def test_a_simulated_node_that_led_a_run_stops_playing_it_when_another_node_leads_its_resize(tmp_path):
    """A simulated node led run be-1; its resize names another node leader (which plays all of a
    simulated job): this node's workers stop at once rather than play on beside the leader's, and
    the command is done."""
    reference = {"entrypoint": ["-m", "trainer_agent.reference"], "integration": "omni"}
    placement = [{"node": "r1", "gpus": [0], "address": "127.0.0.1"}, {"node": "n1", "gpus": [1], "address": "127.0.0.1"}]

    async def scenario():
        agent = _agent(tmp_path)
        supervisor = asyncio.create_task(agent._supervise())
        await _command(agent, "s", "start", _payload(run_id="be-1", workload=reference))
        await asyncio.sleep(0.3)
        mine = agent.jobs["be"]
        await _command(agent, "z", "resize", _payload(run_id="be-1", leader=False, dp=2, gpus=[1], workload=reference,
                                                      placement=placement))
        done = _done_of(agent, "z")
        assert done["ok"] is True
        await asyncio.sleep(0.3)
        assert not mine.alive() and agent.members["be"] == [1]
        supervisor.cancel()

    asyncio.run(scenario())


def test_a_real_node_keeps_simulating_a_job_whose_newest_checkpoint_is_simulated(tmp_path, monkeypatch):
    """A job that ran real (checkpoint 151), then simulated (checkpoint 1059), back on a real
    node: a real trainer would resume 900 steps back, so it stays simulated; with the real
    checkpoint the newer one, it runs real."""
    launched = []

    async def launch(self, dp):
        launched.append(type(self).__name__)

    monkeypatch.setattr(workers.TorchrunJob, "launch", launch)
    monkeypatch.setattr(workers.SimulatedJob, "launch", launch)
    real = tmp_path / "be" / "checkpoints"
    (real / "step-151").mkdir(parents=True)
    (real / "step-151" / "manifest.json").write_text("{}")
    monkeypatch.setattr(workers, "newest_step", lambda directory: 151 if directory == real else 0)
    (tmp_path / "be" / workers.SIM_CHECKPOINT).write_text('{"step": 1059, "dp": 1}')
    agent = NodeAgent("http://127.0.0.1:9", "token", node="n1", gpus=GpuInventory(1), runs_dir=tmp_path)
    payload = _payload(run_id="be-2", placement=[{"node": "n1", "gpus": [0], "address": "127.0.0.1"}],
                       workload={"entrypoint": ["-m", "trainer_agent.reference"], "integration": "omni"})
    asyncio.run(agent._launch("be", payload))
    (tmp_path / "be" / workers.SIM_CHECKPOINT).write_text('{"step": 150, "dp": 1}')
    asyncio.run(agent._launch("be", payload))
    assert launched == ["SimulatedJob", "TorchrunJob"]


def test_a_real_leader_of_a_job_that_spans_a_simulated_node_plays_all_of_it(tmp_path, monkeypatch):
    """The simulated node only tracks its GPUs (it plays no ranks), so a real torchrun here
    would wait at the rendezvous for ever: the leader simulates the whole job instead."""
    launched = []

    async def launch(self, dp):
        launched.append(type(self).__name__)

    monkeypatch.setattr(workers.TorchrunJob, "launch", launch)
    monkeypatch.setattr(workers.SimulatedJob, "launch", launch)
    agent_node._note_simulated_node(tmp_path, "s1")
    agent = NodeAgent("http://127.0.0.1:9", "token", node="r1", gpus=GpuInventory(1), runs_dir=tmp_path)
    workload = {"entrypoint": ["-m", "trainer_agent.reference"], "integration": "omni"}
    spanning = _payload(run_id="be-1", dp=2, workload=workload,
                        placement=[{"node": "r1", "gpus": [0], "address": "127.0.0.1"},
                                   {"node": "s1", "gpus": [1], "address": "127.0.0.1"}])
    asyncio.run(agent._launch("be", spanning))
    alone = _payload(run_id="ok-1", job="ok", workload=workload,
                     placement=[{"node": "r1", "gpus": [0], "address": "127.0.0.1"}])
    asyncio.run(agent._launch("ok", alone))
    assert launched == ["SimulatedJob", "TorchrunJob"]


def test_a_researchers_script_runs_for_real_on_a_simulated_node_too(tmp_path, monkeypatch):
    """Simulated agents play only the reference trainer. A researcher's own script (here a
    signal-mode one) runs for real wherever it lands: alone on a simulated node, across a real
    and a simulated node (both run it, so the ranks meet at the rendezvous), and after a run of
    it that an older agent had played (a stale simulated checkpoint). It used to be played on any
    node noted as simulated, and the demo showed it completed without ever starting the script."""
    launched = []

    async def launch(self, dp):
        launched.append((self.handle.job, type(self).__name__))

    monkeypatch.setattr(workers.TorchrunJob, "launch", launch)
    monkeypatch.setattr(workers.SimulatedJob, "launch", launch)
    agent_node._note_simulated_node(tmp_path, "s1")
    simulated = NodeAgent("http://127.0.0.1:9", "token", node="s1", gpus=GpuInventory(2), runs_dir=tmp_path,
                          simulated_workers=True)
    real = NodeAgent("http://127.0.0.1:9", "token", node="r1", gpus=GpuInventory(1), runs_dir=tmp_path)
    script = {"entrypoint": ["train.py"], "integration": "signal"}
    reference = {"entrypoint": ["-m", "trainer_agent.reference"], "integration": "omni"}
    on_s1 = [{"node": "s1", "gpus": [0], "address": "127.0.0.1"}]
    across = [{"node": "r1", "gpus": [0], "address": "127.0.0.1"}, {"node": "s1", "gpus": [1], "address": "127.0.0.1"}]
    asyncio.run(simulated._launch("mine", _payload(job="mine", run_id="mine-1", workload=script, placement=on_s1)))
    asyncio.run(simulated._launch("ref", _payload(job="ref", run_id="ref-1", workload=reference, placement=on_s1)))
    asyncio.run(real._launch("wide", _payload(job="wide", run_id="wide-1", dp=2, workload=script, placement=across)))
    (tmp_path / "stale").mkdir()
    (tmp_path / "stale" / workers.SIM_CHECKPOINT).write_text('{"step": 40, "dp": 1}')
    asyncio.run(real._launch("stale", _payload(job="stale", run_id="stale-2", workload=script,
                                                placement=[{"node": "r1", "gpus": [0], "address": "127.0.0.1"}])))
    assert launched == [("mine", "TorchrunJob"), ("ref", "SimulatedJob"), ("wide", "TorchrunJob"),
                        ("stale", "TorchrunJob")]


def test_the_record_buffer_drops_the_oldest_and_counts_them(tmp_path, monkeypatch):
    agent = _agent(tmp_path)
    agent.records_out = agent_node.collections.deque(maxlen=5)
    agent.queue_records("be", [{"step": i} for i in range(1, 9)])
    assert agent.dropped_records == 3
    assert [item["record"]["step"] for item in agent.records_out] == [4, 5, 6, 7, 8]
    assert agent.heartbeat_frame()["dropped_records"] == 3


def test_a_steps_frame_is_kept_until_acknowledged_and_sent_again_after_a_reconnect(tmp_path, monkeypatch):
    async def scenario():
        agent = _agent(tmp_path)
        agent.ws = first = _Socket()
        agent.queue_records("be", [{"step": 1}, {"step": 2}])
        await agent._flush()
        agent._records_sent_at = 0.0
        agent.queue_records("be", [{"step": 3}])
        await agent._flush()
        assert first.steps() == [(1, [1, 2]), (2, [3])]
        agent.steps_unacked.on_ack({"type": "steps_ack", "seq": 1})
        agent.steps_unacked.on_ack({"type": "steps_ack", "seq": 99})  # not ours: changes nothing
        agent.steps_unacked.on_ack({"type": "steps_ack", "seq": "2"})
        await agent._flush()
        assert first.steps() == [(1, [1, 2]), (2, [3])]  # nothing due yet: no resend on a live socket

        # The server died with frame 2 in its queue; the next session sends it again after its hello.
        agent.queue_records("be", [{"step": 4}])
        agent._records_sent_at = 0.0
        second = _Socket()
        await agent._session(second)
        types = [f["type"] for f in second.sent]
        assert types.index("hello") < types.index("steps")
        assert second.steps() == [(2, [3]), (3, [4])]

        # Unanswered for STEPS_RESEND_S on a live socket (a database that failed under it): again.
        agent.ws = second
        monkeypatch.setattr(agent_node, "STEPS_RESEND_S", 0.0)
        agent.steps_unacked.on_ack({"type": "steps_ack", "seq": 3})
        await agent._flush()
        assert second.steps() == [(2, [3]), (3, [4]), (2, [3])]
        agent.steps_unacked.on_ack({"type": "steps_ack", "seq": 2})
        monkeypatch.setattr(agent_node, "STEPS_RESEND_S", 30.0)

        # A send that fails keeps the frame for the next session, and the records behind it queued.
        second.fail = True
        agent._records_sent_at = 0.0
        agent.queue_records("be", [{"step": 5}])
        agent.queue_records("other", [{"step": 7}])
        try:
            await agent._flush()
        except ConnectionError:
            pass
        assert list(agent.steps_unacked.frames) == [4]
        assert [(i["job"], i["record"]["step"]) for i in agent.records_out] == [("other", 7)]
        third = _Socket()
        agent._records_sent_at = 0.0
        await agent._session(third)
        assert third.steps() == [(4, [5]), (5, [7])]
        assert agent.dropped_records == 0

    asyncio.run(scenario())


def test_unacknowledged_step_frames_are_bounded_and_what_they_drop_is_counted():
    held = agent_node.UnackedSteps(limit=5)
    dropped = [held.keep({"seq": seq, "records": [{"step": seq * 10 + i} for i in range(2)]}, 0.0)
               for seq in (1, 2, 3)]
    assert dropped == [0, 0, 2]
    assert list(held.frames) == [2, 3] and held.records == 4
    held.on_ack({"seq": 3})
    assert list(held.frames) == [2] and held.records == 2
    # One frame larger than the bound is still held: the newest records are never the ones dropped.
    assert held.keep({"seq": 4, "records": [{"step": 40 + i} for i in range(7)]}, 0.0) == 2
    assert list(held.frames) == [4] and held.records == 7


def test_a_clean_command_removes_the_run_dir_but_never_under_live_ranks(tmp_path):
    async def scenario():
        agent = _agent(tmp_path)
        run_dir = tmp_path / "old-job" / "checkpoints"
        run_dir.mkdir(parents=True)
        (run_dir / "ckpt.pt").write_bytes(b"x" * 5000)
        await _command(agent, "c", "clean", {"job": "old-job", "clean": True}, job="old-job")
        done = [f for f in agent.control_out if f["type"] == "done"][-1]
        assert done["ok"] is True and done["outcome"]["removed"] is True
        assert done["outcome"]["bytes_freed"] >= 5000
        assert not (tmp_path / "old-job").exists()

        await _command(agent, "s", "start", _payload())
        await _command(agent, "c2", "clean", {"job": "be", "clean": True})
        refused = _done_of(agent, "c2")
        assert refused["ok"] is False and "still has live ranks" in refused["outcome"]["error"]
        agent.jobs["be"].signal(signal.SIGKILL)

    asyncio.run(scenario())


def test_a_start_whose_rendezvous_port_is_taken_fails_at_once_so_the_job_recovers(tmp_path):
    import socket

    holder = socket.socket()
    holder.bind(("", 0))
    holder.listen()
    port = holder.getsockname()[1]

    async def scenario():
        agent = NodeAgent("http://127.0.0.1:9", "token", node="n1", gpus=GpuInventory(2), runs_dir=tmp_path)
        payload = _payload(run_id="be-1", rdzv={"host": "127.0.0.1", "port": port},
                           placement=[{"node": "n1", "gpus": [0], "address": "127.0.0.1"}],
                           workload={"entrypoint": ["x.py"], "integration": "signal"})
        await _command(agent, "s", "start", payload)
        done = [f for f in agent.control_out if f["type"] == "done"][0]
        assert done["ok"] is False and f"rendezvous port {port} is in use on n1" in done["outcome"]["error"]
        assert "be" not in agent.jobs  # nothing launched

    try:
        asyncio.run(scenario())
    finally:
        holder.close()


def test_simulated_utilisation_of_a_plain_script_that_reports_only_its_steps_is_nominal_not_zero():
    """GPU samples are simulated here (no NVIDIA driver): from the step's compute share when the
    records split the step, else nominal for a running signal-mode script, with or without lines."""
    plain = workers.WorkerHandle("s", [0], True, state="running", integration="signal")
    assert 0.8 <= plain.utilisation() <= 0.9
    plain.last_record = {"step": 3, "step_s": 1.0}
    assert 0.8 <= plain.utilisation() <= 0.9
    kit = workers.WorkerHandle("o", [0], True, state="running", last_record={"step": 3, "step_s": 1.0, "compute_s": 0.5})
    assert 0.45 <= kit.utilisation() <= 0.51
    assert workers.WorkerHandle("o", [0], True, state="running").utilisation() == 0.0
