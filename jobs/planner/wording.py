"""How reasons name pools, sizes, times and durations for a researcher (one phrasing for every rule).

Times are written the way the planner's clock reads (``PlannerConfig.wall_clock_zone``): in the
simulator as ``t=123s``, in production as a clock time that stays true when the audit row is
read later: ``14:05 UTC`` (with the date when it is not the decision's day), followed by how
long after the decision that is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import UTC, datetime, tzinfo
from functools import lru_cache
from zoneinfo import ZoneInfo


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


def plural(n: int, word: str) -> str:
    """``1 job``, ``3 jobs``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def agree(n: int, one: str, many: str) -> str:
    """The word that agrees with ``n``: ``agree(1, "is", "are")`` is ``is``."""
    return one if n == 1 else many


def gpus_are(n: int, state: str = "free") -> str:
    """``1 GPU is free``, ``3 GPUs are free``."""
    return f"{plural(n, 'GPU')} {agree(n, 'is', 'are')} {state}"


def join_words(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


def gpu_shape(tp: int, pp: int, dp: int) -> str:
    """A job's size at ``dp`` in plain words: ``16 GPUs (2 replicas of 8, each on one node)``."""
    rep = tp * pp
    n = rep * dp
    if rep == 1:
        return plural(n, "GPU")
    groups = f"in groups of {tp} on one node" if tp > 1 and pp > 1 else ""
    if dp == 1:
        return f"{n} GPUs on one node" if pp == 1 else f"{n} GPUs{', ' + groups if groups else ''}"
    where = ", each on one node" if pp == 1 else (", " + groups if groups else "")
    return f"{n} GPUs ({dp} replicas of {rep}{where})"


def returning_sentence(gpus: int, names: Sequence[str], tp: int, pp: int, dp: int) -> str:
    """A hold that waits for GPUs the jobs ``names`` are giving back, then starts at ``dp``."""
    who = join_words(list(names[:5]) + ([f"{len(names) - 5} more"] if len(names) > 5 else [])) or "other jobs"
    way = f"on {agree(gpus, 'its', 'their')} way back"
    return (f"{gpus_are(gpus, way)} from {who}, which {agree(len(names), 'saves', 'save')} a checkpoint first; "
            f"then it starts with {gpu_shape(tp, pp, dp)}.")


def duration_words(seconds: float) -> str:
    """``93784`` -> ``1 d 2 h``, ``2400`` -> ``40 min``, ``42`` -> ``42 s``: short and readable."""
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes = rest // 60
    if days:
        return f"{days} d {hours} h" if hours else f"{days} d"
    if hours:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    return f"{minutes} min" if minutes else f"{seconds} s"


def bytes_words(n: int | float) -> str:
    """``1288490188`` -> ``1.2 GiB``, ``2147483648`` -> ``2 GiB``, ``734003200`` -> ``700 MiB``:
    binary units, one decimal under 10, as ``df -h`` reads."""
    value = float(max(0, n))
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    if unit == "bytes":
        return plural(int(value), "byte")
    text = f"{value:.1f}" if value < 10 else f"{value:.0f}"
    return f"{text.removesuffix('.0')} {unit}"


def low_disk_words(nodes: Sequence[tuple[str, int | None]], minimum_bytes: int) -> str:
    """Why nodes take no new work for lack of disk: ``r0s0n1 has 1.2 GiB free in its runs dir,
    under the 2 GiB minimum`` (``nodes``: name and free bytes, None when unknown)."""
    def free(n: int | None) -> str:
        return bytes_words(n) if n is not None else "too little space"

    minimum = bytes_words(minimum_bytes)
    if len(nodes) == 1:
        name, n = nodes[0]
        return f"{name} has {free(n)} free in its runs dir, under the {minimum} minimum"
    shown = [f"{name} {free(n)}" for name, n in nodes[:3]]
    if len(nodes) > 3:
        shown.append(f"{len(nodes) - 3} more")
    return f"their runs dirs have less than the {minimum} minimum free ({join_words(shown)})"


def signal_stop_words(run_s: float, grace_s: float) -> str:
    """What preempting a signal-mode job costs, for the sentence of the decision that does."""
    return (f"signal-mode job: its checkpoints are not visible to Omni, so preempting it costs all "
            f"{duration_words(run_s)} of work since its last start; it gets SIGTERM and "
            f"{duration_words(grace_s)} to exit before SIGKILL")


@lru_cache(maxsize=16)
def _zone(name: str) -> tzinfo:
    return UTC if name == "UTC" else ZoneInfo(name)


def fmt_t(t: float, now_s: float | None = None, zone: str | None = None) -> str:
    """A planner time, or ``never``.

    Without ``zone`` (the simulator) ``t=1234s``. With a zone (production: ``t`` and ``now_s``
    are Unix seconds) the clock time in that zone, the date when it is not ``now_s``'s day,
    and the distance from ``now_s`` (the decision): ``14:05 UTC (12 min after this decision)``,
    ``09:00 UTC on Dec 4 (18 h after this decision)``.
    """
    if t == math.inf:
        return "never"
    if zone is None:
        return f"t={t:.0f}s"
    tz = _zone(zone)
    at = datetime.fromtimestamp(t, tz)
    text = f"{at:%H:%M} {at.tzname()}"
    if now_s is None:
        return f"{text} on {at:%b} {at.day} {at.year}"
    now = datetime.fromtimestamp(now_s, tz)
    if at.date() != now.date():
        text += f" on {at:%b} {at.day}" + (f" {at.year}" if at.year != now.year else "")
    delta = t - now_s
    if abs(delta) < 1:
        return text + " (at this decision)"
    side = "after" if delta > 0 else "before"
    return f"{text} ({duration_words(abs(delta))} {side} this decision)"
