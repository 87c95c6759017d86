"""The node agent on its own (no server, no torch): duplicate commands are acknowledged again but
applied once, a preempt ends in a checkpoint and a done with its step, and the record buffer
drops its oldest records with a count when the server is away too long."""

from __future__ import annotations

import asyncio
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
        await agent.on_command({"type": "command", "id": "s", "kind": "start", "job": "be", "payload": _payload()})
        for _ in range(100):
            await asyncio.sleep(0.05)
            if agent.jobs["be"].handle.step >= 4:
                break
        await agent.on_command({"type": "command", "id": "p", "kind": "preempt", "job": "be",
                                "payload": _payload(), "deadline": None})
        for _ in range(100):
            await asyncio.sleep(0.05)
            if "be" not in agent.jobs:
                break
        supervisor.cancel()
        done = [f for f in agent.control_out if f["type"] == "done" and f["command"] == "p"]
        assert done and done[0]["ok"] is True
        step = done[0]["outcome"]["checkpoint_step"]
        assert step >= 4 and step == workers.newest_checkpoint_on_disk(tmp_path / "be")

    asyncio.run(scenario())


def test_the_record_buffer_drops_the_oldest_and_counts_them(tmp_path, monkeypatch):
    agent = _agent(tmp_path)
    agent.records_out = agent_node.collections.deque(maxlen=5)
    agent.queue_records("be", [{"step": i} for i in range(1, 9)])
    assert agent.dropped_records == 3
    assert [item["record"]["step"] for item in agent.records_out] == [4, 5, 6, 7, 8]
    assert agent.heartbeat_frame()["dropped_records"] == 3


def test_a_clean_command_removes_the_run_dir_but_never_under_live_ranks(tmp_path):
    async def scenario():
        agent = _agent(tmp_path)
        run_dir = tmp_path / "old-job" / "checkpoints"
        run_dir.mkdir(parents=True)
        (run_dir / "ckpt.pt").write_bytes(b"x" * 5000)
        await agent.on_command({"type": "command", "id": "c", "kind": "clean", "job": "old-job",
                                "payload": {"job": "old-job", "clean": True}})
        done = [f for f in agent.control_out if f["type"] == "done"][-1]
        assert done["ok"] is True and done["outcome"]["removed"] is True
        assert done["outcome"]["bytes_freed"] >= 5000
        assert not (tmp_path / "old-job").exists()

        await agent.on_command({"type": "command", "id": "s", "kind": "start", "job": "be", "payload": _payload()})
        await agent.on_command({"type": "command", "id": "c2", "kind": "clean", "job": "be",
                                "payload": {"job": "be", "clean": True}})
        refused = [f for f in agent.control_out if f["type"] == "done" and f["command"] == "c2"][0]
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
        await agent.on_command({"type": "command", "id": "s", "kind": "start", "job": "be", "payload": payload})
        done = [f for f in agent.control_out if f["type"] == "done"][0]
        assert done["ok"] is False and f"rendezvous port {port} is in use on n1" in done["outcome"]["error"]
        assert "be" not in agent.jobs  # nothing launched

    try:
        asyncio.run(scenario())
    finally:
        holder.close()
