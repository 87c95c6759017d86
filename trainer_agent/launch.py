"""How the node agent starts its share of a job: one torchrun per node, the ranks' environment.

Pure functions of a launch command's payload (docs/workloads.md has the contract). The agent on
every node the job holds runs::

    python -m torch.distributed.run --nnodes N --nproc-per-node G --node-rank R
        --rdzv-backend c10d --rdzv-endpoint LEADER:PORT --rdzv-id RUN_ID --rdzv-conf is_host=1|0
        --max-restarts 0 --no-python PYTHON -m trainer_agent.rank -- ENTRYPOINT...

The leader node hosts the rendezvous store (``is_host=1``); the others only connect. The run id
is new on every launch, so a relaunch never joins an old rendezvous, and the control plane picks
the port so that no two live jobs share one (jobs.actions.commands).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The reference trainer (trainer_agent/reference.py), the default entrypoint.
REFERENCE_ENTRYPOINT = ("-m", "trainer_agent.reference")
# torchrun waits this long for every node's agent to join before it gives up.
JOIN_TIMEOUT_S = 300
# Variables the ranks get from torchrun, or from Omni, which a job's own env may not set.
# After a resize, omni jobs ramp their learning rate up over this many steps (from 10%): the
# new layout's gradient noise settles before the full rate (docs/rhythm.md).
CALIBRATION_STEPS = 5

METRICS_FILE = "metrics.jsonl"  # in the run dir: rank 0's step records (trainer_agent.runtime writes it)

RESERVED_ENV = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
})


def safe_name(job: str) -> str:
    """The job's directory name under the runs dir."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in job)


@dataclass(frozen=True)
class RunPaths:
    """Where one run of a job keeps its files (all under the shared runs dir)."""

    run_dir: Path          # the job's, across runs: checkpoints, metrics.jsonl, control.json
    checkpoint_dir: Path   # OMNI_CHECKPOINT_DIR: survives preemption, the same on every node
    log_dir: Path          # rank-N.out / rank-N.err of this run's ranks on this node
    state_dir: Path        # rank-N.json (pid) and rank-N.exit.json of this run's ranks on this node

    @classmethod
    def of(cls, runs_dir: Path, job: str, run_id: str, node: str) -> RunPaths:
        run_dir = runs_dir / safe_name(job)
        run, here = safe_name(run_id), safe_name(node)
        return cls(run_dir=run_dir, checkpoint_dir=run_dir / "checkpoints", log_dir=run_dir / "logs" / run / here,
                   state_dir=run_dir / ".omni" / run / here)


def resolve_entrypoint(entrypoint: list[str], python: str) -> list[str]:
    """``x.py ...`` and ``-m MODULE ...`` run with the node's Python; anything else is an executable."""
    if not entrypoint:
        raise ValueError("the job has no entrypoint")
    first = entrypoint[0]
    if first == "-m" or first.endswith(".py"):
        return [python, *entrypoint]
    return list(entrypoint)


def local_share(payload: dict[str, Any], node: str) -> tuple[int, list[int]]:
    """This node's place in the job: its node rank and its GPU indices."""
    for index, entry in enumerate(payload["placement"]):
        if entry["node"] == node:
            return index, list(entry["gpus"])
    raise ValueError(f"node {node!r} is not in the job's placement")


def torchrun_argv(payload: dict[str, Any], node: str, python: str) -> list[str]:
    node_rank, gpus = local_share(payload, node)
    rdzv = payload["rdzv"]
    workload = payload["workload"]
    is_host = 1 if node_rank == 0 else 0
    return [
        python, "-m", "torch.distributed.run",
        f"--nnodes={len(payload['placement'])}", f"--nproc-per-node={len(gpus)}", f"--node-rank={node_rank}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv['host']}:{rdzv['port']}", f"--rdzv-id={payload['run_id']}",
        f"--rdzv-conf=is_host={is_host},join_timeout={JOIN_TIMEOUT_S}",
        "--max-restarts=0", "--monitor-interval=0.2", "--no-python",
        python, "-m", "trainer_agent.rank", "--", *resolve_entrypoint(list(workload["entrypoint"]), python),
    ]


def rank_env(payload: dict[str, Any], node: str, paths: RunPaths, base: dict[str, str], *,
             device: str, log_cap_bytes: int | None = None) -> dict[str, str]:
    """The environment torchrun passes to every rank on this node (it adds RANK, WORLD_SIZE...)."""
    _, gpus = local_share(payload, node)
    workload = payload["workload"]
    env = {k: v for k, v in base.items() if k not in RESERVED_ENV and not k.startswith("TORCHELASTIC_")}
    env.update({str(k): str(v) for k, v in (workload.get("env") or {}).items() if k not in RESERVED_ENV})
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # The post-resize calibration ramp is on for omni jobs unless the job's env says otherwise.
    env.setdefault("OMNI_CALIBRATION_STEPS", str(CALIBRATION_STEPS))
    env.update({
        "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus),
        "OMNI_JOB": payload["job"],
        "OMNI_NODE": node,
        "OMNI_RUN_ID": payload["run_id"],
        "OMNI_RUN_DIR": str(paths.run_dir),
        # Where rank 0 appends one JSON line per step; the leader's agent forwards them. A
        # signal-mode script may write ``{"step": N, "step_s": S}`` there too (docs/workloads.md).
        "OMNI_METRICS_FILE": str(paths.run_dir / METRICS_FILE),
        "OMNI_CHECKPOINT_DIR": str(paths.checkpoint_dir),
        "OMNI_LOG_DIR": str(paths.log_dir),
        "OMNI_RANK_STATE_DIR": str(paths.state_dir),
        "OMNI_INTEGRATION": str(workload.get("integration", "omni")),
        "OMNI_DP": str(payload["dp"]),
        "OMNI_ACCUM_STEPS": str(payload["accum"]),
        "OMNI_MICRO_BATCH": str(payload["micro_batch"]),
        "OMNI_GLOBAL_BATCH": str(payload["global_batch"]),
        "OMNI_TOTAL_STEPS": str(payload["total_steps"]),
        "OMNI_CHECKPOINT_EVERY": str(payload.get("checkpoint_every") or 500),
        "OMNI_KEEP_CHECKPOINTS": str(workload.get("keep_checkpoints") or 3),
        "OMNI_DEVICE": device,
        "PYTHONUNBUFFERED": "1",
    })
    if log_cap_bytes:
        env["OMNI_LOG_CAP_BYTES"] = str(log_cap_bytes)
    # The agent's own package must be importable by the rank wrapper, wherever the workdir is.
    package_root = str(Path(__file__).resolve().parents[1])
    path = env.get("PYTHONPATH", "")
    if package_root not in path.split(os.pathsep):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, path) if p)
    return env
