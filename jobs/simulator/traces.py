"""Turn public GPU-cluster job traces (Philly, Acme Kalos) into simulator scenarios.

The traces say what real users submitted (arrival, duration, GPU count) and nothing else, so
every other field a scenario needs (priorities, reservations, parallel layout, batch sizes,
step times, checkpoint costs, idle phases) is an assumption this module adds, deterministically
for a seed, and writes into the scenario's ``comment``. Every rule is described in
``docs/traces.md``. Pure Python: no Django imports; the ``import_trace`` management command is
a thin shell around :func:`import_trace`.
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields, replace
from datetime import datetime
from pathlib import Path
from typing import Any

TRACE_SOURCES = ("philly", "acme")

DAY_S = 86400.0

PHILLY_COLUMNS = ("timestamp", "duration", "num_gpus")
ACME_COLUMNS = ("job_id", "arrival_time", "num_iteration", "gpu_workers", "gpu_per_worker", "profiled_network")

# The Acme converter stores durations as iterations of 0.5 s (see shared/traces/README.md).
ACME_SECONDS_PER_ITERATION = 0.5
ACME_PRETRAIN_NETWORK = 1000


class TraceError(ValueError):
    """A trace file or an import option is unusable; the message is one line naming where."""


@dataclass(frozen=True)
class TraceJob:
    """One job as the trace recorded it, normalised to seconds and GPUs."""

    trace_id: str
    row: int  # 1-based data row in the file (the header is row 0)
    submit_s: float  # seconds since the trace's first submission
    duration_s: float
    gpus: int
    kind: str  # "pretrain" or "sft" for Acme, "" for Philly
    vc: str = ""  # Philly's virtual cluster (the ``cluster`` column), "" when the file has none


@dataclass(frozen=True)
class ImportOptions:
    """Every knob of the import; each source has its own defaults (see ``default_options``)."""

    name: str = ""
    start_day: float = 0.0  # window start, in trace days (after arrival_scale)
    days: float = 7.0  # window length and scenario horizon
    max_jobs: int = 0  # 0 = every job submitted in the window
    gpus: int = 1024  # cluster size
    gpus_per_node: int = 8
    nodes_per_switch: int = 8
    switches_per_rack: int = 4
    seed: int = 0
    arrival_scale: float = 1.0  # arrival offsets are divided by this (time compression)
    gpu_scale: int = 1  # every non-critical job's GPU count is multiplied by this
    critical_fraction: float = 0.4  # reservations cover about this share of the cluster
    critical_min_gpus: int = 8  # trace GPUs a job needs to be a critical candidate
    critical_min_duration_s: float = 12 * 3600.0
    critical_pretrain_only: bool = False  # Acme: only pretrain jobs may become critical
    critical_tp: int = 8  # TP of a critical job (Philly: each trace GPU becomes a TP group)
    critical_max_gpus: int = 0  # 0 = no cap; caps a critical job's size (whole replicas)
    best_effort_max_s: float = 3600.0  # non-critical jobs shorter than this are best-effort
    reservation_lead_s: float = 4 * 3600.0  # a reservation starts this long before its job arrives
    reservation_slack: float = 1.25  # reservation covers the job's expected run times this
    recurring_every: int = 2  # every Nth critical job (1-based: 2nd, 4th, ...) gets a recurring window
    recurring_period_s: float = 3600.0
    recurring_active_s: float = 2400.0
    eval_every_s: float = 7200.0  # critical jobs evaluate (GPUs idle) every this much compute
    eval_s: float = 600.0
    checkpoint_every_s: float = 1800.0  # periodic checkpoint interval, converted to steps
    grow_factor: int = 2  # elastic jobs: dp_max = dp * grow_factor
    shrink_factor: int = 2  # elastic jobs: dp_min = dp / shrink_factor (when it divides)
    step_s_min: float = 1.0  # non-critical step time drawn uniformly in [min, max]
    step_s_max: float = 4.0
    critical_step_s_min: float = 6.0
    critical_step_s_max: float = 12.0
    teams: bool = False  # Philly: one team per virtual cluster, quotas by submitted GPU-hours


def default_options(source: str) -> ImportOptions:
    """The shipped defaults for a trace source: the ones that built the shipped scenarios."""
    if source == "philly":
        return ImportOptions(
            name="philly-week",
            start_day=49.0,
            days=7.0,
            gpus=1024,
            gpu_scale=4,
            critical_fraction=0.5,
            reservation_lead_s=2 * DAY_S,
            reservation_slack=2.0,
            critical_min_gpus=8,
            critical_min_duration_s=24 * 3600.0,
            critical_tp=8,
        )
    if source == "acme":
        return ImportOptions(
            name="acme-llm",
            start_day=0.0,
            days=11.0,
            gpus=1536,
            arrival_scale=8.0,
            gpu_scale=1,
            critical_fraction=0.5,
            reservation_lead_s=2 * DAY_S,
            reservation_slack=2.0,
            critical_min_gpus=256,
            critical_min_duration_s=24 * 3600.0,
            critical_pretrain_only=True,
            critical_tp=8,
            grow_factor=1,
            step_s_min=2.0,
            step_s_max=6.0,
            critical_step_s_min=8.0,
            critical_step_s_max=16.0,
        )
    raise TraceError(f"unknown trace source {source!r}; expected one of {', '.join(TRACE_SOURCES)}")


# ---------------------------------------------------------------------------------------------
# Reading the trace files


def _open_rows(path: Path, required: Iterable[str]) -> tuple[list[dict[str, str]], str]:
    """Read a CSV with a header, checking that the required columns exist."""
    label = path.name
    if not path.exists():
        raise TraceError(f"{path}: no such file")
    if not path.is_file():
        raise TraceError(f"{path}: not a file")
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            header = reader.fieldnames or []
            missing = [column for column in required if column not in header]
            if missing:
                raise TraceError(
                    f"{label}: missing column(s) {', '.join(missing)} (header has: {', '.join(header) or 'nothing'})"
                )
            rows = list(reader)
    except UnicodeDecodeError as exc:
        raise TraceError(f"{label}: not a UTF-8 text CSV ({exc.reason})") from None
    except csv.Error as exc:
        raise TraceError(f"{label}: malformed CSV ({exc})") from None
    if not rows:
        raise TraceError(f"{label}: no data rows")
    return rows, label


def _number(label: str, row: int, row_dict: dict[str, str], column: str, *, minimum: float) -> float:
    raw = row_dict.get(column)
    try:
        value = float(raw) if raw is not None else math.nan
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise TraceError(f"{label} row {row}: column {column}: {raw!r} is not a number")
    if value < minimum:
        raise TraceError(f"{label} row {row}: column {column}: {raw!r} is below {minimum:g}")
    return value


def _whole(label: str, row: int, row_dict: dict[str, str], column: str, *, minimum: int) -> int:
    value = _number(label, row, row_dict, column, minimum=minimum)
    if value != int(value):
        raise TraceError(f"{label} row {row}: column {column}: {row_dict[column]!r} is not a whole number")
    return int(value)


def read_philly_trace(path: str | Path) -> list[TraceJob]:
    """Read ``philly.csv`` (timestamp, duration, num_gpus, ...) into jobs sorted by arrival."""
    rows, label = _open_rows(Path(path), PHILLY_COLUMNS)
    parsed: list[tuple[datetime, float, int, int]] = []
    for index, row_dict in enumerate(rows, start=1):
        raw_time = row_dict.get("timestamp") or ""
        try:
            stamp = datetime.fromisoformat(raw_time.strip())
        except ValueError:
            raise TraceError(f"{label} row {index}: column timestamp: {raw_time!r} is not a date-time") from None
        duration_s = _number(label, index, row_dict, "duration", minimum=0.0)
        gpus = _whole(label, index, row_dict, "num_gpus", minimum=1)
        parsed.append((stamp.replace(tzinfo=None), duration_s, gpus, index, (row_dict.get("cluster") or "").strip()))
    first = min(stamp for stamp, _, _, _, _ in parsed)
    jobs = [
        TraceJob(
            trace_id=str(index),
            row=index,
            submit_s=(stamp - first).total_seconds(),
            duration_s=max(duration_s, 1.0),
            gpus=gpus,
            kind="",
            vc=vc,
        )
        for stamp, duration_s, gpus, index, vc in parsed
    ]
    jobs.sort(key=lambda job: (job.submit_s, job.row))
    return jobs


def read_acme_trace(path: str | Path) -> list[TraceJob]:
    """Read the converted Acme Kalos ``kalos.csv`` into jobs sorted by arrival.

    Duration is ``num_iteration * 0.5`` s, GPUs ``gpu_workers * gpu_per_worker``, and
    ``profiled_network`` 1000 marks a pretrain job (500: SFT or other); the other columns are
    converter constants and are ignored.
    """
    rows, label = _open_rows(Path(path), ACME_COLUMNS)
    jobs: list[TraceJob] = []
    seen: set[str] = set()
    for index, row_dict in enumerate(rows, start=1):
        job_id = (row_dict.get("job_id") or "").strip()
        if not job_id:
            raise TraceError(f"{label} row {index}: column job_id: empty")
        if job_id in seen:
            raise TraceError(f"{label} row {index}: column job_id: {job_id!r} repeats an earlier row")
        seen.add(job_id)
        arrival_s = _number(label, index, row_dict, "arrival_time", minimum=0.0)
        iterations = _number(label, index, row_dict, "num_iteration", minimum=0.0)
        workers = _whole(label, index, row_dict, "gpu_workers", minimum=1)
        per_worker = _whole(label, index, row_dict, "gpu_per_worker", minimum=1)
        network = _number(label, index, row_dict, "profiled_network", minimum=0.0)
        jobs.append(
            TraceJob(
                trace_id=job_id,
                row=index,
                submit_s=arrival_s,
                duration_s=max(iterations * ACME_SECONDS_PER_ITERATION, 1.0),
                gpus=workers * per_worker,
                kind="pretrain" if network >= ACME_PRETRAIN_NETWORK else "sft",
            )
        )
    first = min(job.submit_s for job in jobs)
    jobs = [replace(job, submit_s=job.submit_s - first) for job in jobs]
    jobs.sort(key=lambda job: (job.submit_s, job.row))
    return jobs


def read_trace(source: str, path: str | Path) -> list[TraceJob]:
    """Read a trace file of the given source (``philly`` or ``acme``)."""
    if source == "philly":
        return read_philly_trace(path)
    if source == "acme":
        return read_acme_trace(path)
    raise TraceError(f"unknown trace source {source!r}; expected one of {', '.join(TRACE_SOURCES)}")


# ---------------------------------------------------------------------------------------------
# Building the scenario


def check_options(options: ImportOptions) -> None:
    """Refuse option values that cannot make a valid scenario, with one line naming the option."""
    positive = (
        "days", "gpus", "gpus_per_node", "nodes_per_switch", "switches_per_rack", "arrival_scale",
        "gpu_scale", "critical_tp", "recurring_period_s", "recurring_active_s", "checkpoint_every_s",
        "grow_factor", "shrink_factor", "step_s_min", "step_s_max", "critical_step_s_min",
        "critical_step_s_max", "reservation_slack", "recurring_every", "critical_min_gpus",
    )
    for key in positive:
        if not getattr(options, key) > 0:
            raise TraceError(f"--{key.replace('_', '-')}: must be positive, got {getattr(options, key)}")
    non_negative = ("start_day", "max_jobs", "critical_fraction", "critical_min_duration_s", "critical_max_gpus",
                    "best_effort_max_s", "reservation_lead_s", "eval_every_s", "eval_s")
    for key in non_negative:
        if getattr(options, key) < 0:
            raise TraceError(f"--{key.replace('_', '-')}: must not be negative, got {getattr(options, key)}")
    if options.critical_fraction > 1:
        raise TraceError(f"--critical-fraction: must be at most 1, got {options.critical_fraction}")
    if options.recurring_active_s > options.recurring_period_s:
        raise TraceError("--recurring-active-s: must not exceed --recurring-period-s")
    if options.gpus % options.gpus_per_node:
        raise TraceError(f"--gpus: {options.gpus} is not a multiple of --gpus-per-node {options.gpus_per_node}")
    if options.critical_tp > options.gpus_per_node or options.gpus_per_node % options.critical_tp:
        raise TraceError(f"--critical-tp: {options.critical_tp} must divide --gpus-per-node {options.gpus_per_node}")
    if options.step_s_min > options.step_s_max or options.critical_step_s_min > options.critical_step_s_max:
        raise TraceError("--step-s-min/--step-s-max: the minimum exceeds the maximum")


def cluster_shape(options: ImportOptions) -> dict[str, Any]:
    """A regular rack/switch/node shape when the GPU count allows one, else an explicit node list."""
    nodes = options.gpus // options.gpus_per_node
    per_rack = options.nodes_per_switch * options.switches_per_rack
    if nodes % per_rack == 0:
        return {
            "racks": nodes // per_rack,
            "switches_per_rack": options.switches_per_rack,
            "nodes_per_switch": options.nodes_per_switch,
            "gpus_per_node": options.gpus_per_node,
        }
    node_list = []
    for index in range(nodes):
        switch_index = index // options.nodes_per_switch
        rack = switch_index // options.switches_per_rack
        switch = switch_index % options.switches_per_rack
        node = index % options.nodes_per_switch
        node_list.append(
            {"name": f"r{rack}s{switch}n{node}", "rack": f"r{rack}", "switch": f"r{rack}s{switch}",
             "gpus": options.gpus_per_node}
        )
    return {"nodes": node_list}


def window_jobs(trace_jobs: list[TraceJob], options: ImportOptions) -> list[TraceJob]:
    """Jobs submitted inside the window, arrival offsets rescaled and made relative to its start."""
    start_s = options.start_day * DAY_S
    end_s = start_s + options.days * DAY_S
    selected: list[TraceJob] = []
    for job in trace_jobs:
        scaled_s = job.submit_s / options.arrival_scale
        if start_s <= scaled_s < end_s:
            selected.append(replace(job, submit_s=round(scaled_s - start_s, 1)))
    if options.max_jobs:
        selected = selected[: options.max_jobs]
    return selected


def _layout_llm(gpus: int, gpus_per_node: int, tp: int) -> tuple[int, int, int]:
    """TP x PP x DP for a multi-node LLM job: TP fills a node, PP up to 4 when it divides."""
    if gpus < tp:
        return 1, 1, gpus
    for pp in (4, 2, 1):
        if gpus >= 256 and gpus % (tp * pp) == 0:
            return tp, pp, gpus // (tp * pp)
    return tp, 1, gpus // tp


def _batch(micro_batch: int, dps: Iterable[int], target_global_batch: int) -> int:
    """The multiple of micro_batch * lcm(dps) nearest the target (at least one), so every listed dp divides."""
    unit = micro_batch * math.lcm(*dps)
    return unit * max(1, round(target_global_batch / unit))


def _steps_every(every_s: float, step_s: float) -> int:
    return max(1, round(every_s / step_s))


def choose_critical(jobs: list[TraceJob], options: ImportOptions) -> list[TraceJob]:
    """The long, large trace jobs that become critical, largest GPU-time inside the window first.

    Candidates need ``critical_min_gpus`` trace GPUs and ``critical_min_duration_s``; they are
    taken until their GPUs (as critical jobs) reach ``critical_fraction`` of the cluster.
    """
    budget = options.critical_fraction * options.gpus
    candidates = [
        job
        for job in jobs
        if job.gpus >= options.critical_min_gpus
        and job.duration_s >= options.critical_min_duration_s
        and (job.kind == "pretrain" or not options.critical_pretrain_only)
        and critical_gpus(job, options) <= options.gpus
    ]
    horizon_s = options.days * DAY_S
    candidates.sort(key=lambda job: (-min(job.duration_s, horizon_s - job.submit_s) * job.gpus, job.submit_s, job.row))
    chosen: list[TraceJob] = []
    total = 0
    for job in candidates:
        if total >= budget:
            break
        size = critical_gpus(job, options)
        if total + size > budget * 1.25 and chosen:
            continue
        chosen.append(job)
        total += size
    chosen.sort(key=lambda job: (job.submit_s, job.row))
    return chosen


def critical_gpus(job: TraceJob, options: ImportOptions) -> int:
    """GPUs a critical job runs on: Philly's small jobs grow to one TP group per trace GPU."""
    if job.gpus < options.critical_tp:
        size = job.gpus * options.critical_tp
    elif job.kind:  # Acme: the trace size, rounded down to whole nodes
        size = job.gpus - job.gpus % options.critical_tp
    else:
        size = job.gpus * options.critical_tp
    if options.critical_max_gpus:
        size = min(size, options.critical_max_gpus - options.critical_max_gpus % options.critical_tp)
    return max(size, options.critical_tp)


def _critical_job(job: TraceJob, index: int, rng: random.Random, options: ImportOptions, horizon_s: float
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The job and reservation entries for one critical trace job."""
    gpus = critical_gpus(job, options)
    tp, pp, dp = _layout_llm(gpus, options.gpus_per_node, options.critical_tp)
    step_s = round(rng.uniform(options.critical_step_s_min, options.critical_step_s_max), 2)
    total_steps = max(1, round(job.duration_s / step_s))
    save_s = round(30 + 0.09 * gpus)
    entry: dict[str, Any] = {
        "name": _job_name(job, "crit"),
        "owner": _owner(job),
        "priority": "critical",
        "submit_s": job.submit_s,
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "global_batch": _batch(1 if job.kind else 4, [dp], 1024),
        "micro_batch": 1 if job.kind else 4,
        "total_steps": total_steps,
        "step_s": step_s,
        "checkpoint": {
            "every_steps": _steps_every(options.checkpoint_every_s, step_s),
            "save_s": save_s,
            "load_s": 2 * save_s,
        },
    }
    run_s = job.duration_s
    if options.eval_every_s and options.eval_s:
        entry["idle_phases"] = [{"every_steps": _steps_every(options.eval_every_s, step_s), "duration_s": options.eval_s}]
        run_s += options.eval_s * (total_steps // _steps_every(options.eval_every_s, step_s))
    run_s += save_s * (total_steps // entry["checkpoint"]["every_steps"]) + 2 * save_s
    recurring = index % options.recurring_every == options.recurring_every - 1
    start_s = max(0.0, job.submit_s - options.reservation_lead_s)
    reservation: dict[str, Any] = {"name": f"{entry['name']}-res", "job": entry["name"], "gpus": tp * pp * dp}
    if recurring:
        run_s *= options.recurring_period_s / options.recurring_active_s
        reservation["period_s"] = options.recurring_period_s
        reservation["active_s"] = options.recurring_active_s
    end_s = min(horizon_s, job.submit_s + run_s * options.reservation_slack)
    reservation["start_s"] = round(start_s, 1)
    reservation["end_s"] = round(max(end_s, start_s + 1.0), 1)
    return entry, reservation


def _job_name(job: TraceJob, prefix: str) -> str:
    source = "acme" if job.kind else "philly"
    kind = f"-{job.kind}" if job.kind else ""
    return f"{source}{kind}-{prefix}-{job.trace_id}"


def _owner(job: TraceJob) -> str:
    return f"kalos-{job.kind}" if job.kind else "philly"


def _regular_job(job: TraceJob, rng: random.Random, options: ImportOptions) -> dict[str, Any]:
    """The job entry for one non-critical trace job (regular or best-effort, elastic)."""
    gpus = min(job.gpus * options.gpu_scale, options.gpus)
    if job.kind == "pretrain":
        tp, pp, dp = _layout_llm(gpus, options.gpus_per_node, options.critical_tp)
        micro_batch, target_batch = 1, 1024
    elif job.kind == "sft" and gpus >= options.gpus_per_node:
        tp, pp, dp = min(4, options.gpus_per_node), 1, gpus // min(4, options.gpus_per_node)
        micro_batch, target_batch = 4, 256
    else:
        tp, pp, dp = 1, 1, gpus
        micro_batch, target_batch = 32 if not job.kind else 4, 256
    replica = tp * pp
    dp_min = dp // options.shrink_factor if dp % options.shrink_factor == 0 else dp
    dp_max = max(dp, min(dp * options.grow_factor, options.gpus // replica))
    best_effort = job.duration_s < options.best_effort_max_s
    step_s = round(rng.uniform(options.step_s_min, options.step_s_max), 2)
    if job.kind == "pretrain":
        step_s = round(step_s * 3, 2)
    total_steps = max(1, round(job.duration_s / step_s))
    save_s = round(30 + 0.09 * gpus) if job.kind == "pretrain" else (20 if job.kind else 10)
    entry: dict[str, Any] = {
        "name": _job_name(job, "be" if best_effort else "reg"),
        "owner": _owner(job),
        "priority": "best_effort" if best_effort else "regular",
        "submit_s": job.submit_s,
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "dp_min": max(1, dp_min),
        "dp_max": dp_max,
        "global_batch": _batch(micro_batch, [max(1, dp_min), dp, dp_max], target_batch),
        "micro_batch": micro_batch,
        "total_steps": total_steps,
        "step_s": step_s,
        "checkpoint": {
            "every_steps": _steps_every(options.checkpoint_every_s, step_s),
            "save_s": save_s,
            "load_s": 2 * save_s,
        },
    }
    return entry


def build_scenario(source: str, trace_jobs: list[TraceJob], options: ImportOptions) -> dict[str, Any]:
    """The scenario dict (FORMAT.md keys only) for a trace, deterministic for ``options.seed``."""
    check_options(options)
    jobs = window_jobs(trace_jobs, options)
    if not jobs:
        raise TraceError(
            f"no trace jobs submitted in the window (start day {options.start_day:g}, {options.days:g} days, "
            f"arrival scale {options.arrival_scale:g})"
        )
    horizon_s = options.days * DAY_S
    rng = random.Random(options.seed)
    critical = {job.row for job in choose_critical(jobs, options)}
    scenario_jobs: list[dict[str, Any]] = []
    reservations: list[dict[str, Any]] = []
    gpu_s_by_vc: dict[str, float] = {}
    dropped = 0
    for job in jobs:
        if job.row in critical:
            entry, reservation = _critical_job(job, len(reservations), rng, options, horizon_s)
            reservations.append(reservation)
        else:
            entry = _regular_job(job, rng, options)
            if entry["dp_min"] * entry["tp"] * entry["pp"] > options.gpus:
                dropped += 1
                continue
        if options.teams:
            entry["team"] = _team_name(job)
            gpu_s_by_vc[entry["team"]] = gpu_s_by_vc.get(entry["team"], 0.0) + \
                entry["tp"] * entry["pp"] * entry["dp"] * job.duration_s
        scenario_jobs.append(entry)
    scenario: dict[str, Any] = {
        "name": options.name or f"{source}-trace",
        "comment": describe_assumptions(source, options, scenario_jobs, reservations, dropped),
        "horizon_s": horizon_s,
        "seed": options.seed,
        "cluster": cluster_shape(options),
        "jobs": scenario_jobs,
        "reservations": reservations,
    }
    if options.teams:
        scenario["teams"] = [{"name": name, "quota_gpus": quota}
                             for name, quota in team_quotas(gpu_s_by_vc, options.gpus).items()]
    return scenario


def _team_name(job: TraceJob) -> str:
    return f"vc-{job.vc}"


def team_quotas(gpu_s_by_team: dict[str, float], gpus: int) -> dict[str, int]:
    """Whole-GPU quotas in proportion to each team's submitted GPU-seconds, summing to ``gpus``
    (largest remainder; ties by name), in name order."""
    total = sum(gpu_s_by_team.values())
    names = sorted(gpu_s_by_team)
    if total <= 0:
        return dict.fromkeys(names, 0)
    exact = {name: gpus * gpu_s_by_team[name] / total for name in names}
    quotas = {name: math.floor(share) for name, share in exact.items()}
    left = gpus - sum(quotas.values())
    for name in sorted(names, key=lambda n: (-(exact[n] - quotas[n]), n))[:left]:
        quotas[name] += 1
    return quotas


def describe_assumptions(source: str, options: ImportOptions, jobs: list[dict[str, Any]],
                         reservations: list[dict[str, Any]], dropped: int) -> str:
    """The scenario's comment: what came from the trace and every assumption added to it."""
    counts = {priority: sum(1 for job in jobs if job["priority"] == priority)
              for priority in ("critical", "regular", "best_effort")}
    recurring = sum(1 for reservation in reservations if "period_s" in reservation)
    trace_file = "philly/philly.csv" if source == "philly" else "acme-kalos/kalos.csv"
    parts = [
        f"Trace-driven scenario built by `manage.py import_trace {source}` from shared/traces/{trace_file}; "
        "every rule below is explained in docs/traces.md.",
        f"Window: jobs submitted from trace day {options.start_day:g} for {options.days:g} days "
        f"(arrival offsets divided by {options.arrival_scale:g}), horizon = window; jobs running before the "
        f"window are not modelled (the cluster starts empty). {len(jobs)} jobs: {counts['critical']} critical, "
        f"{counts['regular']} regular, {counts['best_effort']} best-effort; {dropped} dropped as larger than the cluster.",
        f"Cluster: {options.gpus} GPUs, {options.gpus_per_node} per node, {options.nodes_per_switch} nodes per "
        f"switch, {options.switches_per_rack} switches per rack.",
        f"Critical: trace jobs with >= {options.critical_min_gpus} GPUs and >= {options.critical_min_duration_s:g} s"
        f"{' (pretrain only)' if options.critical_pretrain_only else ''}, largest GPU-time first, until their GPUs "
        f"reach {options.critical_fraction:g} of the cluster; run at TP {options.critical_tp}"
        f"{' with one TP group per trace GPU' if source == 'philly' else ' at their trace size'}, not elastic, "
        f"step {options.critical_step_s_min:g}-{options.critical_step_s_max:g} s, an evaluation (GPUs idle) of "
        f"{options.eval_s:g} s every {options.eval_every_s:g} s of compute.",
        f"Reservations: one per critical job, its full size, from {options.reservation_lead_s:g} s before it "
        f"arrives to {options.reservation_slack:g}x its expected run; critical jobs number {options.recurring_every}, "
        f"{2 * options.recurring_every}, ... (by arrival) are periodic, active {options.recurring_active_s:g} s of every {options.recurring_period_s:g} s "
        f"({recurring} of {len(reservations)}).",
        f"Others: GPUs x {options.gpu_scale}; best-effort when shorter than {options.best_effort_max_s:g} s, else "
        f"regular; elastic dp_min = dp/{options.shrink_factor} (when it divides), dp_max = dp x "
        f"{options.grow_factor}; step {options.step_s_min:g}-{options.step_s_max:g} s"
        f"{' (x3 for pretrain)' if source == 'acme' else ''}; total_steps = trace duration / step_s.",
        "Layouts: below one node TP 1 (data parallel); Acme SFT TP 4; pretrain and critical TP "
        f"{options.critical_tp}, PP 4 or 2 at >= 256 GPUs when it divides; global batch = the multiple "
        "of micro_batch x lcm(dp_min, dp, dp_max) nearest the target (256 small jobs, 1024 pretrain).",
        f"Checkpoints every ~{options.checkpoint_every_s:g} s of steps; save 10 s (Philly), 20 s (SFT), "
        "30 + 0.09 x GPUs s (pretrain, critical); load = 2 x save. Seed "
        f"{options.seed} draws the step times.",
    ]
    if options.teams:
        parts.append("Teams: one per Philly virtual cluster (vc-ID), each job in its VC's team; quotas in "
                     "proportion to the GPU-hours each VC submits in the window at the sizes above (critical "
                     f"jobs included), rounded to whole GPUs summing to {options.gpus}; no borrowing limit, weight 1.")
    return " ".join(parts)


def import_trace(source: str, path: str | Path, options: ImportOptions | None = None) -> dict[str, Any]:
    """Read a trace file and build its scenario dict (raises TraceError with one line on bad input)."""
    if source not in TRACE_SOURCES:
        raise TraceError(f"unknown trace source {source!r}; expected one of {', '.join(TRACE_SOURCES)}")
    options = options or default_options(source)
    check_options(options)
    if options.teams and source != "philly":
        raise TraceError(f"--teams: the {source} trace has no virtual clusters to make teams of (philly only)")
    trace_jobs = read_trace(source, path)
    if options.teams and any(not job.vc for job in trace_jobs):
        row = next(job.row for job in trace_jobs if not job.vc)
        raise TraceError(f"--teams: {Path(path).name} row {row}: no cluster (virtual cluster) to make a team of")
    return build_scenario(source, trace_jobs, options)


def options_with(source: str, overrides: dict[str, Any]) -> ImportOptions:
    """The source's defaults with the given (non-None) overrides applied."""
    known = {field.name for field in fields(ImportOptions)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise TraceError(f"unknown import option(s): {', '.join(unknown)}")
    values = {key: value for key, value in overrides.items() if value is not None}
    defaults = default_options(source)
    options = replace(defaults, **values)
    if "name" not in values and (options.start_day, options.days) != (defaults.start_day, defaults.days):
        # Another window is another scenario: do not let it pass for the shipped one.
        options = replace(options, name=f"{source}-day{options.start_day:g}-{options.days:g}d")
    if "name" not in values and options.teams:
        options = replace(options, name=f"{options.name}-teams")
    return options


def option_names() -> list[str]:
    """The names of every import option, in declaration order."""
    return list(asdict(ImportOptions()).keys())


OPTION_HELP: dict[str, str] = {
    "name": "scenario name (default: philly-week / acme-llm, or SOURCE-dayD-Nd for another window)",
    "start_day": "window start in trace days, after --arrival-scale",
    "days": "window length in days; also the scenario horizon",
    "max_jobs": "keep only the first N jobs of the window (0: all)",
    "gpus": "cluster size in GPUs (a multiple of --gpus-per-node)",
    "gpus_per_node": "GPUs per node",
    "nodes_per_switch": "nodes per switch",
    "switches_per_rack": "switches per rack",
    "seed": "scenario seed; also draws the step times",
    "arrival_scale": "divide trace arrival offsets by this (time compression)",
    "gpu_scale": "multiply every non-critical job's trace GPU count by this",
    "critical_fraction": "reservations cover about this share of the cluster's GPUs",
    "critical_min_gpus": "trace GPUs a job needs to become critical",
    "critical_min_duration_s": "trace duration a job needs to become critical",
    "critical_pretrain_only": "only pretrain jobs may become critical (Acme)",
    "critical_tp": "tensor-parallel degree of critical jobs",
    "critical_max_gpus": "cap on a critical job's GPUs (0: none)",
    "best_effort_max_s": "non-critical jobs shorter than this are best-effort",
    "reservation_lead_s": "a reservation starts this long before its job arrives",
    "reservation_slack": "a reservation lasts this many times its job's expected run",
    "recurring_every": "every Nth critical job gets a recurring (periodic) reservation",
    "recurring_period_s": "period of recurring reservations",
    "recurring_active_s": "active part of each period",
    "eval_every_s": "critical jobs evaluate (GPUs idle) after this much compute (0: never)",
    "eval_s": "length of each evaluation",
    "checkpoint_every_s": "periodic checkpoint interval, converted to steps",
    "grow_factor": "elastic jobs: dp_max = dp x this",
    "shrink_factor": "elastic jobs: dp_min = dp / this when it divides",
    "step_s_min": "non-critical step time is drawn uniformly from [min, max]",
    "step_s_max": "see --step-s-min",
    "critical_step_s_min": "critical step time is drawn uniformly from [min, max]",
    "critical_step_s_max": "see --critical-step-s-min",
    "teams": "Philly: one team per virtual cluster, quotas in proportion to its submitted GPU-hours",
}
