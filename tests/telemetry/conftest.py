"""Fixtures for the telemetry tests: a node whose agent holds a real token, and batch builders."""

from __future__ import annotations

import time

import pytest


@pytest.fixture
def node(make_nodes):
    """An 8-GPU node; ``node.token`` is its agent token (only the hash is stored)."""
    first = make_nodes(racks=1, switches=1, nodes=1, gpus=8)[0]
    first.token = first.issue_token()
    first.save(update_fields=["agent_token_hash"])
    return first


def gpu_batch(seq: int = 0, *, samples: int = 16, start_s: float | None = None, source: str = "agent-test",
              util_pct: float = 50.0) -> dict:
    """``samples`` readings cycling over 8 GPUs, one second apart per GPU, ending about now."""
    start_s = time.time() - samples if start_s is None else start_s
    return {
        "source": source,
        "seq": seq,
        "samples": [
            {"gpu": i % 8, "at": start_s + i // 8, "util_pct": util_pct, "mem_used_bytes": 40 * 2**30,
             "power_w": 500.0, "temp_c": 60.0, "xid_errors": 0}
            for i in range(samples)
        ],
    }
