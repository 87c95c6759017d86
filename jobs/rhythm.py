"""What a job's step records say about its rhythm, kept up to date record by record (no Django).

``RhythmState`` is one job's measured rhythm: a ring of its last ``RHYTHM_WINDOW`` step times at
its current DP (with their mean and deviation), its measured save and load times, the gaps
between steps (an evaluation, a checkpoint, a data stall) and what recurs among them (the idle
phases the planner may lend the GPUs through), where each step's time went (data wait,
compute, communication), how well the mean predicted each next step, and which ranks run
consistently slower than the job's median (stragglers). ``observe`` folds a batch of step
records in; the state round-trips through JSON (``as_json`` / ``from_json``), one row per job
(``jobs.models.JobRhythm``). The planner reads it through ``jobs.snapshot``. docs/rhythm.md.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from jobs.planner.snapshot import IdlePhase

RHYTHM_WINDOW = 200           # step times kept (the planner's window)
HISTORY = 20                  # saves, loads, gaps kept
ERRORS = 200                  # prediction errors kept
STRAGGLER_WINDOW = 20         # steps a rank must be slow over before it is a straggler
STRAGGLER_SHARE = 0.8         # ... in at least this share of them
GAP_MIN_S = 1.0               # an off-step gap shorter than this is noise
GAP_MIN_FACTOR = 3.0          # ... and so is one shorter than this many mean steps
STALL_SHARE = 0.5             # a step whose data wait is this share of it is a data stall
SHARES = ("data_wait", "comm", "compute")
SHARE_WORDS = {"data_wait": "data wait", "comm": "communication", "compute": "compute"}
SHORT_STEPS = 10              # the recent shares: an EWMA over about this many steps
LONG_STEPS = 200              # ... and the usual ones
DROP_POINTS = 0.15            # a fall of the compute share this large (absolute) is a drop
BOTTLENECK_SHARE = 0.25       # data wait or communication above this share is named
DIAGNOSIS_STEPS = 10          # step records before the sentence on where the time goes
HEALTH_WINDOW = 20            # losses before a change it is judged against
HEALTH_AFTER = 5              # steps after a resize or resume that are checked
SPIKE_SIGMAS = 4.0            # a loss this many deviations above the window before is a spike
SPIKE_MIN_RISE = 0.05         # ... and at least this much above its mean (relative)
LOSS_STEPS = 50               # the GPU time a job loses: an EWMA of wall time over about this many steps
LOSS_PARTS = ("data_wait", "comm", "checkpoint", "pause")
LOSS_WORDS = {"data_wait": "data wait", "comm": "communication", "checkpoint": "checkpoints",
              "pause": "pauses off the step loop (evaluation, anything else)"}


@dataclass
class Gap:
    """Time off the step loop after ``step``: an evaluation, a checkpoint, a stall."""

    step: int
    duration_s: float
    kind: str                 # "checkpoint", "data_stall" or "pause" (evaluation, anything else)


@dataclass
class Phase:
    """An idle phase that recurs: after every ``every_steps`` steps, ``duration_s`` off the GPUs."""

    every_steps: int
    duration_s: float
    kind: str
    seen: int                 # how many times it was observed
    offset_steps: int = 0     # it follows steps offset, offset + every, ... (the last one seen, modulo)

    def next_after(self, step: int) -> int:
        """The first step after ``step`` it follows (as jobs.planner.snapshot.IdlePhase counts)."""
        return IdlePhase(self.every_steps, self.duration_s, self.offset_steps).next_after(step)


@dataclass
class RhythmState:
    """One job's measured rhythm (see the module docstring)."""

    dp: int | None = None
    step_s: list[float] = field(default_factory=list)
    mean_s: float = 0.0
    stdev_s: float = 0.0
    last_step: int = 0
    last_at: float | None = None
    save_s: list[float] = field(default_factory=list)
    load_s: list[float] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)
    # Shares of step time over the window (data wait, communication, compute), as EWMAs.
    shares: dict[str, float] = field(default_factory=dict)
    # |actual - predicted| / actual of each step predicted by the mean before it.
    errors: list[float] = field(default_factory=list)
    # Per rank: the last STRAGGLER_WINDOW ratios of its compute time to the other ranks' median.
    rank_ratios: dict[str, list[float]] = field(default_factory=dict)
    rank_nodes: list[str] = field(default_factory=list)
    records: int = 0
    # The same shares over a long horizon, and the last drop of the compute share against it.
    long_shares: dict[str, float] = field(default_factory=dict)
    recent_s: dict[str, float] = field(default_factory=dict)   # EWMA seconds per part (and "step")
    usual_s: dict[str, float] = field(default_factory=dict)
    # Post-change health: the recent losses and layouts, the change being watched, the findings.
    losses: list[list[float]] = field(default_factory=list)    # [step, loss], the last HEALTH_WINDOW
    layout: dict[str, int] = field(default_factory=dict)       # dp, accum, micro_batch, global_batch
    change: dict[str, Any] | None = None
    run: str | None = None                                      # the run (launch) the last record came from
    findings: list[dict[str, Any]] = field(default_factory=list)   # the last HISTORY
    checks: int = 0                                             # findings ever made
    save_errors: list[float] = field(default_factory=list)      # of the planner's save prediction (worst of the last 20)
    drop: dict[str, Any] | None = None
    # Continuity counters of the last record: optimizer steps and samples drawn, less what the
    # step number implies (constant while the run goes on as it should).
    offsets: dict[str, int] = field(default_factory=dict)
    # The next idle phase the planner expects (kind, after which step, how long), and how well
    # such predictions came true (relative error of the duration; 1.0 for one that did not come).
    next_idle: dict[str, Any] | None = None
    idle_errors: list[float] = field(default_factory=list)
    # Reclaims: the predicted stop (mean step + measured save), the lead the planner gave, what it took.
    reclaims: list[dict[str, float]] = field(default_factory=list)
    # Wall time per step as an EWMA, by where it went (compute, the LOSS_PARTS, "wall").
    wall_s: dict[str, float] = field(default_factory=dict)

    # -- serialisation -----------------------------------------------------------------------

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> RhythmState:
        if not data:
            return cls()
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        state = cls(**known)
        state.gaps = [g if isinstance(g, Gap) else Gap(**g) for g in state.gaps]
        return state

    # -- derived figures ---------------------------------------------------------------------

    def error_percentiles(self, errors: list[float] | None = None, at_least: int = 10) -> tuple[float | None, float | None]:
        """p50 and p95 of the step-time prediction error (relative; or of ``errors``), once there
        are ``at_least``."""
        errors = self.errors if errors is None else errors
        if len(errors) < at_least:
            return None, None
        ordered = sorted(errors)
        return _percentile(ordered, 0.50), _percentile(ordered, 0.95)

    def accuracy(self) -> dict[str, dict[str, float | int]]:
        """How well each prediction the planner acts on came true, by kind (``step``, ``save``,
        ``idle``, ``reclaim``): relative error p50 and p95 and how many were scored."""
        out = {}
        for kind, errors, at_least in (("step", self.errors, 10), ("save", self.save_errors, 3),
                                       ("idle", self.idle_errors, 3), ("reclaim", self.reclaim_errors(), 1)):
            p50, p95 = self.error_percentiles(errors, at_least=at_least)
            if p50 is not None and p95 is not None:
                out[kind] = {"p50": round(p50, 4), "p95": round(p95, 4), "n": len(errors)}
        return out

    def phases(self, checkpoint_every: int | None = None) -> list[Phase]:
        """The idle phases that recur, by kind: a regular step interval between gaps of one kind
        (a checkpoint's is its period when the job has one), and their median length."""
        out = []
        for kind in ("pause", "checkpoint", "data_stall"):
            gaps = [g for g in self.gaps if g.kind == kind]
            if len(gaps) < 2:
                continue
            intervals = [b.step - a.step for a, b in zip(gaps, gaps[1:], strict=False) if b.step > a.step]
            if not intervals:
                continue
            every = statistics.mode(intervals)
            if kind == "checkpoint" and checkpoint_every:
                every = checkpoint_every
            regular = sum(1 for i in intervals if i == every) / len(intervals)
            if every <= 0 or regular < 0.6:
                continue
            out.append(Phase(every, statistics.median(g.duration_s for g in gaps), kind, len(gaps),
                             gaps[-1].step % every))
        return out

    def stragglers(self, factor: float) -> dict[int, float]:
        """Ranks slower than the other ranks' median by ``factor`` in ``STRAGGLER_SHARE`` of the last
        ``STRAGGLER_WINDOW`` steps: rank -> its median ratio over the window."""
        out = {}
        for rank, ratios in self.rank_ratios.items():
            if len(ratios) < STRAGGLER_WINDOW:
                continue
            slow = sum(1 for r in ratios if r >= factor)
            if slow >= STRAGGLER_SHARE * len(ratios):
                out[int(rank)] = statistics.median(ratios)
        return out

    def recovered(self, rank: int, factor: float) -> bool:
        """Whether ``rank`` ran at most halfway to ``factor`` over the whole last window."""
        ratios = self.rank_ratios.get(str(rank), [])
        limit = 1.0 + (factor - 1.0) / 2.0
        return len(ratios) >= STRAGGLER_WINDOW and statistics.median(ratios) <= limit

    # -- folding records in ------------------------------------------------------------------

    def observe(self, records: Iterable[Mapping[str, Any]], *, dp: int, checkpoint_every: int | None = None) -> int:
        """Fold step records in (oldest first; an old or repeated step is skipped). Returns how
        many were new. A record measured at another DP than the ring's restarts the ring: the
        planner's window is the step time at the job's current size."""
        new = 0
        for record in sorted(records, key=lambda r: r.get("step", 0)):
            step = record.get("step")
            step_s = _finite(record.get("step_s"))
            at = _finite(record.get("at"))
            if not isinstance(step, int) or step_s is None or step_s <= 0:
                continue
            rewound = False
            if step <= self.last_step:
                if at is None or self.last_at is None or at <= self.last_at:
                    continue  # a record sent again
                self.last_step, self.last_at = step - 1, None  # a resume from an older checkpoint
                rewound = True
            record_dp = record.get("dp") if isinstance(record.get("dp"), int) else dp
            self._watch_change(step, record, record_dp, rewound)
            if record_dp != self.dp:
                self.dp, self.step_s, self.mean_s, self.stdev_s = record_dp, [], 0.0, 0.0
                self.rank_ratios = {}
            off, off_kind = self._note_gap(step, step_s, at, record, checkpoint_every)
            self._score_idle(step)
            if self.step_s:
                predicted = self.mean_s
                self.errors = (self.errors + [abs(step_s - predicted) / step_s])[-ERRORS:]
            self.step_s = (self.step_s + [step_s])[-RHYTHM_WINDOW:]
            self.mean_s = sum(self.step_s) / len(self.step_s)
            self.stdev_s = math.sqrt(sum((v - self.mean_s) ** 2 for v in self.step_s) / len(self.step_s))
            self._note_shares(step_s, record)
            self._note_wall(step_s, off, off_kind, record)
            self._note_ranks(record)
            if isinstance(record.get("rank_nodes"), list):
                self.rank_nodes = [str(n) for n in record["rank_nodes"]]
            self.last_step, self.last_at = step, at
            self.records += 1
            new += 1
            self._note_health(step, record)
            if self.next_idle is None:
                self.next_idle = self._predict_idle(checkpoint_every)
        return new

    # -- after a resize or a resume: did the run go on as it was? ----------------------------

    def _watch_change(self, step: int, record: Mapping[str, Any], dp: int, rewound: bool) -> None:
        resized = bool(self.layout) and self.layout.get("dp") != dp
        run = record.get("run") if isinstance(record.get("run"), str) else None
        relaunched = run is not None and self.run is not None and run != self.run
        if run is not None:
            self.run = run
        if not (resized or rewound or relaunched) or self.change is not None:
            return
        before = [loss for _, loss in self.losses]
        self.change = {
            "kind": "resize" if resized else "resume", "step": step, "expected_step": self.last_step + 1,
            "layout_before": dict(self.layout), "offsets_before": dict(self.offsets),
            "loss_mean": statistics.fmean(before) if before else None,
            "loss_stdev": statistics.pstdev(before) if len(before) > 1 else None,
            "after": [],
        }

    def _note_health(self, step: int, record: Mapping[str, Any]) -> None:
        loss = _finite(record.get("loss"))
        layout = {name: record[name] for name in ("dp", "accum", "micro_batch", "global_batch")
                  if isinstance(record.get(name), int)}
        offsets = _offsets(step, record, layout.get("global_batch"))
        change = self.change
        if change is not None:
            change["after"].append([step, loss, layout, offsets])
            if len(change["after"]) >= HEALTH_AFTER:
                self.findings = (self.findings + [self._judge(change)])[-HISTORY:]
                self.checks += 1
                self.change = None
        if loss is not None:
            self.losses = (self.losses + [[step, loss]])[-HEALTH_WINDOW:]
        if layout:
            self.layout = layout
        if offsets:
            self.offsets = offsets

    @staticmethod
    def _judge(change: dict[str, Any]) -> dict[str, Any]:
        after = change["after"]
        first_step, first_layout = after[0][0], after[0][2]
        after = [entry if len(entry) > 3 else [*entry, {}] for entry in after]
        before = change["layout_before"]
        problems, notes = [], []
        mean, stdev = change["loss_mean"], change["loss_stdev"]
        losses = [entry[1] for entry in after if entry[1] is not None]
        started_over = first_step <= 1 and change["kind"] != "resize"
        if started_over and losses:
            # A run that started over (no checkpoint, or a signal-mode script's own save lost)
            # has an untrained model's loss: nothing before it is comparable.
            notes.append("it started over, so its loss is not compared with the run before")
        elif mean is not None and stdev is not None and losses:
            worst = max(losses)
            limit = max(mean + SPIKE_SIGMAS * stdev, mean * (1 + SPIKE_MIN_RISE))
            if worst > limit:
                problems.append(f"the loss spiked to {worst:.4g} against {mean:.4g} ± {stdev:.2g} over the "
                                f"{HEALTH_WINDOW} steps before")
            else:
                notes.append(f"loss {worst:.4g} at most, within {SPIKE_SIGMAS:g} deviations of the steps before "
                             f"({mean:.4g} ± {stdev:.2g})")
        g_before, g_after = before.get("global_batch"), first_layout.get("global_batch")
        if g_before and g_after and g_before != g_after:
            problems.append(f"the global batch changed {g_before} -> {g_after}")
        elif g_after:
            accum = f" (accumulation {before.get('accum')} -> {first_layout.get('accum')})" if before.get("accum") != first_layout.get("accum") else ""
            notes.append(f"global batch {g_after} kept{accum}")
        for _, _, layout, _ in after:
            if all(k in layout for k in ("dp", "accum", "micro_batch", "global_batch")) and \
                    layout["dp"] * layout["accum"] * layout["micro_batch"] != layout["global_batch"]:
                problems.append(f"dp {layout['dp']} x accumulation {layout['accum']} x micro-batch "
                                f"{layout['micro_batch']} is not the global batch {layout['global_batch']}")
                break
        problems += _continuity(change.get("offsets_before") or {}, [entry[3] if len(entry) > 3 else {} for entry in after], notes)
        steps = [entry[0] for entry in after]
        if steps != list(range(first_step, first_step + len(steps))):
            problems.append(f"steps did not follow one another after the change ({steps})")
        else:
            notes.append(f"steps went on from {first_step}")
        # "the restart from step 1", not "the resume at step 1": nothing was resumed.
        what = "resize at step" if change["kind"] == "resize" else ("restart from step" if started_over else "resume at step")
        layout_words = (f" (dp {before.get('dp')} -> {first_layout.get('dp')})"
                        if change["kind"] == "resize" else "")
        if problems:
            text = f"After the {what} {first_step}{layout_words}: " + "; ".join(problems) + "."
        else:
            text = f"After the {what} {first_step}{layout_words} the run is healthy: " + "; ".join(notes) + "."
        return {"step": first_step, "kind": change["kind"], "healthy": not problems, "text": text}

    def observe_checkpoint(self, save_s: float | None = None, load_s: float | None = None) -> None:
        """A measured save or load (from a command's outcome)."""
        if save_s is not None and save_s >= 0:
            if self.save_s and save_s > 0:
                self.save_errors = (self.save_errors + [abs(save_s - max(self.save_s)) / save_s])[-ERRORS:]
            self.save_s = (self.save_s + [float(save_s)])[-HISTORY:]
        if load_s is not None and load_s >= 0:
            self.load_s = (self.load_s + [float(load_s)])[-HISTORY:]

    def _note_gap(self, step: int, step_s: float, at: float | None, record: Mapping[str, Any],
                  checkpoint_every: int | None) -> tuple[float, str]:
        """Note a gap before this record (or a stalled step); returns the off-step seconds before
        it and their kind ("pause" for the small overheads between steps too)."""
        data_wait = _finite(record.get("data_wait_s")) or 0.0
        if data_wait >= STALL_SHARE * step_s and data_wait >= GAP_MIN_S:
            self.gaps = (self.gaps + [Gap(step, data_wait, "data_stall")])[-HISTORY:]
        if at is None or self.last_at is None or step != self.last_step + 1 or not self.step_s:
            return 0.0, "pause"
        off = max(0.0, (at - self.last_at) - step_s)  # wall time between the two steps not spent stepping
        previous = step - 1
        kind = "checkpoint" if checkpoint_every and previous % checkpoint_every == 0 else "pause"
        if off >= max(GAP_MIN_S, GAP_MIN_FACTOR * self.mean_s):
            self.gaps = (self.gaps + [Gap(previous, off, kind)])[-HISTORY:]
        return off, kind

    # -- the next idle window: predicted, then scored --------------------------------------------

    def _predict_idle(self, checkpoint_every: int | None) -> dict[str, Any] | None:
        """The earliest recurring idle phase still to come, as the planner sees it: after every
        ``every_steps``-th step (jobs.planner.rhythm.next_idle_phase)."""
        best = None
        for phase in self.phases(checkpoint_every=checkpoint_every):
            after = phase.next_after(self.last_step)
            if best is None or after < best["after_step"]:
                best = {"kind": phase.kind, "after_step": after, "duration_s": phase.duration_s}
        return best

    def _score_idle(self, step: int) -> None:
        """Score the pending idle prediction once the step it concerns has been seen: a data stall
        is in the step itself, a pause or checkpoint in the gap after it."""
        pending = self.next_idle
        if pending is None:
            return
        due = pending["after_step"] + (0 if pending["kind"] == "data_stall" else 1)
        if step < due:
            return
        self.next_idle = None
        if step > due:
            return  # steps were skipped (a resume): nothing to score
        # The window is the GPUs off the step loop: a pause predicted where a checkpoint fell came too.
        stall = pending["kind"] == "data_stall"
        seen = [g for g in self.gaps if (g.kind == "data_stall") == stall and g.step == pending["after_step"]]
        error = 1.0 if not seen else min(1.0, abs(seen[-1].duration_s - pending["duration_s"]) / seen[-1].duration_s)
        self.idle_errors = (self.idle_errors + [error])[-ERRORS:]

    def observe_reclaim(self, predicted_s: float, lead_s: float, took_s: float) -> None:
        """A reclaim's outcome: it was predicted to stop in ``predicted_s`` and given ``lead_s``; it took ``took_s``."""
        self.reclaims = (self.reclaims + [{"predicted_s": predicted_s, "lead_s": lead_s, "took_s": took_s}])[-HISTORY:]

    def reclaim_errors(self) -> list[float]:
        """|took - predicted| over the larger of the two (a stop far quicker than predicted scores
        near 1, not near infinity)."""
        return [abs(r["took_s"] - r["predicted_s"]) / max(r["took_s"], r["predicted_s"])
                for r in self.reclaims if max(r["took_s"], r["predicted_s"]) > 0]

    # -- where the time goes ----------------------------------------------------------------------

    def _note_wall(self, step_s: float, off: float, off_kind: str, record: Mapping[str, Any]) -> None:
        """The wall time of this step and the gap before it, split: compute, data wait,
        communication, checkpoints, pauses (an EWMA over about ``LOSS_STEPS`` steps)."""
        parts = _within_step(step_s, {name: max(0.0, _finite(record.get(f"{name}_s")) or 0.0) for name in SHARES})
        parts["compute"] += max(0.0, step_s - sum(parts.values()))  # time not attributed is the step's own
        parts.update(checkpoint=0.0, pause=0.0)
        parts[off_kind] += off
        parts["wall"] = step_s + off
        _blend(self.wall_s, parts, 2.0 / (min(self.records + 1, LOSS_STEPS) + 1))

    def lost(self) -> tuple[float, str] | None:
        """The share of wall time the job's GPUs are not computing, and what takes most of it."""
        wall = self.wall_s.get("wall") or 0.0
        if self.records < SHORT_STEPS or wall <= 0:
            return None
        share = max(0.0, min(1.0, 1.0 - self.wall_s.get("compute", 0.0) / wall))
        cause = max(LOSS_PARTS, key=lambda n: self.wall_s.get(n, 0.0))
        return share, cause

    def _note_shares(self, step_s: float, record: Mapping[str, Any]) -> None:
        # Shares of *time* (EWMAs of seconds, then ratios): a 1.5 s stall every eighth 50 ms step
        # is most of the time spent, which a mean of per-step shares would hide.
        parts = {name: _finite(record.get(f"{name}_s")) for name in SHARES}
        if any(v is None for v in parts.values()):
            return
        parts = _within_step(step_s, {name: max(0.0, v) for name, v in parts.items()})
        parts["step"] = step_s
        _blend(self.recent_s, parts, 2.0 / (min(self.records + 1, SHORT_STEPS) + 1))
        _blend(self.usual_s, parts, 2.0 / (min(self.records + 1, LONG_STEPS) + 1))
        self.shares = {n: self.recent_s[n] / self.recent_s["step"] for n in SHARES}
        self.long_shares = {n: self.usual_s[n] / self.usual_s["step"] for n in SHARES}
        before, now = self.long_shares["compute"], self.shares["compute"]
        if self.records >= SHORT_STEPS and before - now >= DROP_POINTS:
            cause = max(("data_wait", "comm"), key=lambda n: self.shares[n] - self.long_shares[n])
            if self.drop is None or self.drop.get("step", 0) < self.last_step - LONG_STEPS:
                self.drop = {"step": int(record.get("step", 0)), "at": _finite(record.get("at")),
                             "compute_before": before, "compute_after": now, "cause": cause,
                             "cause_before": self.long_shares[cause], "cause_after": self.shares[cause]}
        elif self.drop is not None and now >= before - DROP_POINTS / 3:
            self.drop = None  # recovered

    def diagnosis(self, bubble: float = 0.0, clock: Any = None) -> str | None:
        """Where each step's time goes, in one sentence, and why it changed when the GPUs' busy
        share fell (``clock`` turns an epoch time into words, e.g. ``14:05 UTC``)."""
        if self.records < DIAGNOSIS_STEPS or not self.shares:
            return None
        d = self.drop
        if d is not None:
            when = f" at {clock(d['at'])}" if clock is not None and d.get("at") else f" at step {d['step']}"
            return (f"GPU busy time fell from {d['compute_before']:.0%} to {d['compute_after']:.0%} of each step{when}: "
                    f"{SHARE_WORDS[d['cause']]} rose from {d['cause_before']:.0%} to {d['cause_after']:.0%}.")
        compute, data, comm = (self.shares[n] for n in ("compute", "data_wait", "comm"))
        words = f"Each step is {compute:.0%} compute, {data:.0%} data wait and {comm:.0%} communication"
        if bubble > 0:
            words += f", of which about {bubble:.0%} is pipeline bubble"
        if data >= BOTTLENECK_SHARE:
            return words + ": the input pipeline holds the GPUs back."
        if comm >= BOTTLENECK_SHARE:
            return words + ": communication holds the GPUs back."
        return words + "."

    def _note_ranks(self, record: Mapping[str, Any]) -> None:
        compute = record.get("rank_compute_s")
        if not isinstance(compute, list) or len(compute) < 2:
            return
        values = [_finite(v) for v in compute]
        if any(v is None or v < 0 for v in values):
            return
        for rank, value in enumerate(values):
            # Against the median of the *other* ranks: with two ranks the median of all would
            # be their mean, and a 2x straggler would look only 1.33x slow.
            others = statistics.median(values[:rank] + values[rank + 1:])
            if others <= 0:
                continue
            ratios = self.rank_ratios.get(str(rank), [])
            self.rank_ratios[str(rank)] = (ratios + [value / others])[-STRAGGLER_WINDOW:]


def _within_step(step_s: float, parts: dict[str, float]) -> dict[str, float]:
    """Seconds per part of a step, scaled down to the step when they add up to more: they come
    from different ranks (the slowest's wait and communication, the mean compute)."""
    total = sum(parts.values())
    if total > step_s > 0:
        return {name: v * step_s / total for name, v in parts.items()}
    return parts


def _blend(seconds: dict[str, float], parts: Mapping[str, float], alpha: float) -> None:
    """Fold ``parts`` into the EWMAs ``seconds`` with weight ``alpha`` (the first value as is)."""
    for name, value in parts.items():
        previous = seconds.get(name)
        seconds[name] = value if previous is None else previous + alpha * (value - previous)


def _offsets(step: int, record: Mapping[str, Any], global_batch: int | None) -> dict[str, int]:
    """The record's optimizer step count less its step, and its data position (samples drawn
    through this step) less ``step x global batch``: both constant while the run goes on as it should."""
    out = {}
    opt = record.get("opt_step")
    if isinstance(opt, int) and not isinstance(opt, bool):
        out["opt_step"] = opt - step
    data = record.get("data_pos")
    if isinstance(data, int) and not isinstance(data, bool) and global_batch:
        out["data_pos"] = data - step * global_batch
    return out


def _continuity(before: Mapping[str, int], after: list[Mapping[str, int]], notes: list[str]) -> list[str]:
    """Problems with the optimizer step count and data position after a change (notes when they
    continued)."""
    problems = []
    for name, words, unit in (("opt_step", "optimizer step count", "steps"), ("data_pos", "data position", "samples")):
        if name not in before or not any(name in a for a in after):
            continue
        off = [a[name] - before[name] for a in after if name in a and a[name] != before[name]]
        if off:
            problems.append(f"the {words} did not continue: {off[0]:+d} {unit} against the step count")
        else:
            notes.append(f"{words} continued")
    return problems


def bubble_share(pp: int, micro_batches: int) -> float:
    """A pipeline's idle share per step with ``pp`` stages and ``micro_batches`` per step (GPipe/1F1B)."""
    if pp <= 1:
        return 0.0
    return (pp - 1) / (max(1, micro_batches) + pp - 1)


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _percentile(ordered: list[float], q: float) -> float:
    index = q * (len(ordered) - 1)
    low = math.floor(index)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (index - low)
