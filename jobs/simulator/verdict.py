"""Where ``omni`` stands against the peers, figure by figure, on one scenario's replays.

The claim the simulator is there to check (docs/simulator.md, "The peers side by side") is that
the planner is ahead of every peer (``slurm``, ``kueue``, ``elastic``) on:

* utilisation and goodput (higher is better);
* the median and p95 completion time and queueing delay of each priority class (lower);
* preemptions per completed job (lower);

and, as bounds rather than races, no critical reservation shortfall and lost GPU-seconds at most
``LOST_SHARE_MAX`` of ``kill_preempt``'s. Both bounds leave node failures aside (the shortfall while
an owner recovers from one, ``reservation_shortfall_faults_aside``, and the steps one throws away,
``lost_gpu_s_by_cause["fault"]``): a failure costs every policy the same. ``verdict`` works that
out from ``simulate``'s result dicts, so a reader of ``simulate --policy all`` sees at once which
figures a peer leads, by how much, and which peer; it decides nothing about the planner.

A completion time is over the jobs of the class that completed, as in the tables; where the best
peer completed fewer of them than omni its figure says so (``completed``), since finishing fewer,
shorter jobs lowers a median.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from jobs.planner.snapshot import PRIORITIES

PEERS = ("slurm", "kueue", "elastic")
BASELINE = "kill_preempt"
#: omni's lost GPU-seconds may be at most this share of ``kill_preempt``'s.
LOST_SHARE_MAX = 0.10
CLASS_FIGURES = (
    ("jct_median_s", "completion time median"),
    ("jct_p95_s", "completion time p95"),
    ("queue_median_s", "queueing delay median"),
    ("queue_p95_s", "queueing delay p95"),
)


class Figure(NamedTuple):
    """One raced figure of one policy's result."""

    key: str  # e.g. ``utilization``, ``regular.jct_p95_s``
    words: str
    higher_is_better: bool
    value: float | None  # None: no job of the class completed
    completed: int | None = None  # for a completion time: the jobs it is over


def _figures(result: Mapping[str, Any]) -> list[Figure]:
    """Each raced figure of ``result``, a class's only where the class has jobs."""
    out = [Figure("utilization", "utilisation", True, result.get("utilization")),
           Figure("goodput", "goodput", True, result.get("goodput"))]
    classes = result.get("classes") or {}
    for cls in PRIORITIES:
        figures = classes.get(cls)
        if not figures or not figures.get("jobs"):
            continue
        for key, words in CLASS_FIGURES:
            done = figures.get("completed") if key.startswith("jct") else None
            out.append(Figure(f"{cls}.{key}", f"{cls.replace('_', '-')} {words}", False, figures.get(key), done))
    out.append(Figure("preemptions_per_completed_job", "preemptions per completed job", False,
                      result.get("preemptions_per_completed_job")))
    return out


def _better(a: float, b: float, higher: bool) -> bool:
    return a > b if higher else a < b


def verdict(results: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """omni against the peers among ``results`` (one scenario, one result per policy): each raced
    figure with omni's value, the best peer's and whether omni is ahead or level, then the bounds.
    None when the results hold no omni or no peer."""
    by_policy = {r.get("policy"): r for r in results}
    omni = by_policy.get("omni")
    peers = [p for p in PEERS if p in by_policy]
    if omni is None or not peers:
        return None
    rows: list[dict[str, Any]] = []
    peer_figures = {p: {f.key: f for f in _figures(by_policy[p])} for p in peers}
    for ours in _figures(omni):
        higher = ours.higher_is_better
        best: tuple[str, Figure] | None = None
        for peer in peers:
            theirs = peer_figures[peer].get(ours.key)
            if theirs is None or theirs.value is None:
                continue
            if best is None or _better(theirs.value, best[1].value, higher):
                best = (peer, theirs)
        if best is None:
            continue  # no peer has this figure (no job of the class completed under any)
        peer, theirs = best
        row = {"figure": ours.key, "words": ours.words, "higher_is_better": higher, "omni": ours.value,
               "best_peer": peer, "best_peer_value": theirs.value,
               "ahead": ours.value is not None and not _better(theirs.value, ours.value, higher)}
        if ours.completed is not None and theirs.completed is not None:
            row["omni_completed"], row["best_peer_completed"] = ours.completed, theirs.completed
        rows.append(row)
    aside = omni.get("reservation_shortfall_faults_aside")
    shortfall = float(omni.get("reservation_shortfall") or 0.0) if aside is None else float(aside)
    bounds: list[dict[str, Any]] = [
        {"figure": "reservation_shortfall", "words": "critical reservation shortfall, node failures aside",
         "omni": shortfall, "limit": 0.0, "met": shortfall <= 0.0},
    ]
    baseline = by_policy.get(BASELINE)
    if baseline is not None:
        limit = LOST_SHARE_MAX * _thrown_away(baseline)
        lost = _thrown_away(omni)
        bounds.append({"figure": "lost_gpu_s", "omni": lost, "limit": limit, "met": lost <= limit,
                       "words": f"GPU-s thrown away by stops (at most {LOST_SHARE_MAX:.0%} of {BASELINE}'s)"})
    return {"peers": peers, "figures": rows, "ahead": sum(r["ahead"] for r in rows), "of": len(rows),
            "behind": [r for r in rows if not r["ahead"]], "bounds": bounds}


def _thrown_away(result: Mapping[str, Any]) -> float:
    """The GPU-seconds of steps a policy's own stops threw away (``lost_gpu_s_by_cause["kill"]``):
    what node failures throw away is the same under every policy, so not the policy's doing."""
    by_cause = result.get("lost_gpu_s_by_cause")
    return float(by_cause.get("kill") or 0.0) if by_cause else float(result.get("lost_gpu_s") or 0.0)


def verdict_value(key: str, value: float | None) -> str:
    """A figure's or a bound's value as the verdict shows it."""
    if value is None:
        return "none completed"
    if key in ("utilization", "goodput"):
        return f"{value * 100:.2f}%"
    if key == "preemptions_per_completed_job":
        return f"{value:.2f}"
    if key == "reservation_shortfall":
        return f"{value * 100:.3f}%"
    if key == "lost_gpu_s":
        return f"{value:,.0f}"
    return f"{value:,.0f} s"


def format_verdict(found: Mapping[str, Any] | None) -> str:
    """The verdict as text lines for ``simulate``'s table (empty without omni and a peer)."""
    if found is None:
        return ""
    peers = ", ".join(found["peers"])
    lines = [f"omni against the peers ({peers}): ahead or level on {found['ahead']} of {found['of']} figures"
             + ("; behind on:" if found["behind"] else "")]
    for row in found["behind"]:
        done = ""
        if "best_peer_completed" in row and row["best_peer_completed"] < row["omni_completed"]:
            done = f", over {row['best_peer_completed']} completed jobs against omni's {row['omni_completed']}"
        lines.append(f"  {row['words']}: {verdict_value(row['figure'], row['omni'])} "
                     f"({row['best_peer']} {verdict_value(row['figure'], row['best_peer_value'])}{done})")
    for bound in found["bounds"]:
        shown = verdict_value(bound["figure"], bound["omni"])
        if bound["figure"] != "reservation_shortfall":  # whose limit, 0, goes without saying
            shown += f" against a limit of {verdict_value(bound['figure'], bound['limit'])}"
        lines.append(f"  {bound['words']}: {shown}: {'met' if bound['met'] else 'NOT MET'}")
    return "\n".join(lines) + "\n"
