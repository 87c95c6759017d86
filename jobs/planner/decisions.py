"""The planner's output: an ordered plan of actions, each with a structured reason.

An ``Action`` is what the control plane sends to one job (or records, for ``hold``); its
``to_audit()`` dict is the audit row the Django side stores and the simulator prints with
``--events``.

Action kinds and what applying one means:

``place``    start a waiting job on ``gpus_after`` (loads its checkpoint unless first start).
``lend``     like ``place``/``grow`` but some ``gpus_after`` are reserved GPUs lent to the job
             (``borrowed_from`` names the reservation; ``deadline_s`` is when the loan ends).
             With empty ``gpus_after`` on a job in an idle phase (rule ``harvest.idle``): the
             job lends its own GPUs for the rest of the phase and gets them back at its end.
``preempt``  the job finishes its step, saves (``graceful``) or is killed (not graceful),
             and releases every GPU; ``deadline_s`` is when it must have saved.
``shrink``   the job saves and continues at a smaller DP on ``gpus_after`` (a subset).
``grow``     the job saves and continues at a larger DP on ``gpus_after`` (a superset).
``reclaim``  a borrower gives back lent GPUs: a ``preempt`` or ``shrink`` whose purpose is to
             return a reservation's GPUs by ``deadline_s``.
``recover``  a job hit by a fault restarts from its last checkpoint on ``gpus_after``.
``migrate``  the job moves replicas off a slow or drained node: same DP, new GPUs.
``hold``     the job stays waiting; the reason says why ("why is my job pending").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from jobs.planner.snapshot import Gpu
from jobs.vocab import ActionKind


def _jsonable(value: Any) -> Any:
    """``value`` with inf/nan replaced by None and tuples by lists, so strict JSON accepts it."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value) if isinstance(value, set | frozenset) else value
        return [_jsonable(v) for v in items]
    return value


ACTION_KINDS = tuple(ActionKind)


@dataclass(frozen=True, slots=True)
class Reason:
    """Why an action was chosen: the rule, a plain sentence, and the numbers that decided it."""

    rule: str
    text: str
    inputs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (non-finite numbers become None)."""
        return {"rule": self.rule, "text": self.text, "inputs": _jsonable(dict(self.inputs))}


@dataclass(frozen=True, slots=True)
class Action:
    """One decision about one job; see the module docstring for what each kind means."""

    kind: ActionKind  # a plain string of the same value compares (and serialises) equal
    job: str
    reason: Reason
    gpus_before: tuple[Gpu, ...] = ()
    gpus_after: tuple[Gpu, ...] = ()
    dp_before: int = 0
    dp_after: int = 0
    accum_before: int | None = None
    accum_after: int | None = None
    global_batch: int | None = None
    borrowed_from: tuple[str, ...] = ()
    deadline_s: float | None = None
    graceful: bool = True
    forced: bool = False

    def to_audit(self) -> dict[str, Any]:
        """A JSON-able audit record of this action (without the time, which the caller adds)."""
        return {
            "kind": self.kind,
            "job": self.job,
            "gpus_before": len(self.gpus_before),
            "gpus_after": len(self.gpus_after),
            "nodes_before": sorted({g.node for g in self.gpus_before}),
            "nodes_after": sorted({g.node for g in self.gpus_after}),
            "dp_before": self.dp_before,
            "dp_after": self.dp_after,
            "accum_before": self.accum_before,
            "accum_after": self.accum_after,
            "global_batch": self.global_batch,
            "borrowed_from": list(self.borrowed_from),
            "deadline_s": _jsonable(self.deadline_s),
            "graceful": self.graceful,
            "forced": self.forced,
            "reason": self.reason.to_dict(),
        }

    def to_dict(self) -> dict[str, Any]:
        """Full JSON-able form, GPUs included (``from_dict`` reverses it)."""
        out = self.to_audit()
        out["gpus_before"] = [[g.node, g.index] for g in self.gpus_before]
        out["gpus_after"] = [[g.node, g.index] for g in self.gpus_after]
        del out["nodes_before"], out["nodes_after"]
        return out

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Action:
        """Rebuild an action from ``to_dict`` output."""
        r = d["reason"]
        return Action(
            kind=d["kind"],
            job=d["job"],
            reason=Reason(r["rule"], r["text"], dict(r.get("inputs", {}))),
            gpus_before=tuple(Gpu(n, int(i)) for n, i in d.get("gpus_before", ())),
            gpus_after=tuple(Gpu(n, int(i)) for n, i in d.get("gpus_after", ())),
            dp_before=d.get("dp_before", 0),
            dp_after=d.get("dp_after", 0),
            accum_before=d.get("accum_before"),
            accum_after=d.get("accum_after"),
            global_batch=d.get("global_batch"),
            borrowed_from=tuple(d.get("borrowed_from", ())),
            deadline_s=d.get("deadline_s"),
            graceful=d.get("graceful", True),
            forced=d.get("forced", False),
        )


@dataclass(frozen=True, slots=True)
class Plan:
    """An ordered tuple of actions, plus when the planner next wants to be asked.

    ``wake_at_s`` is the earliest future time at which a decision already foreseen falls due
    (for example a loan's reclaim must start); callers should run a pass then at the latest.
    """

    actions: tuple[Action, ...] = ()
    wake_at_s: float | None = None
    paused: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "actions": [a.to_dict() for a in self.actions],
            "wake_at_s": self.wake_at_s,
            "paused": self.paused,
        }

    def by_kind(self, kind: str) -> list[Action]:
        """Actions of one kind, in plan order."""
        return [a for a in self.actions if a.kind == kind]
