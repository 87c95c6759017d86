"""How reasons name pools, sizes and times for a researcher (one phrasing for every rule)."""

from __future__ import annotations

import math


def pool_label(name: str) -> str:
    """How a pool is named to a researcher: a reservation, or a job's lent-out idle phase."""
    if name.startswith("idle:"):
        return f"the idle phase of {name[5:]}"
    return f"reservation '{name}'"


def upper_first(text: str) -> str:
    """``text`` with its first letter capitalised, to open a sentence."""
    return text[:1].upper() + text[1:]


def replica_count(n: int) -> str:
    """``1 replica``, ``3 replicas``."""
    return f"{n} replica" if n == 1 else f"{n} replicas"


def fmt_t(t: float) -> str:
    """A planner time as ``t=1234s``, or ``never``."""
    return "never" if t == math.inf else f"t={t:.0f}s"
