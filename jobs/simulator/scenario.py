"""Scenario files: strict loading and validation per the scenario format (docs/simulator.md).

``load_scenario(path)`` / ``parse_scenario(data)`` return a ``Scenario`` or raise
``ScenarioError`` whose ``str()`` is one line naming the field: ``jobs[3].tp: 16 exceeds
gpus_per_node 8``. Unknown keys are errors so typos never pass silently.

Extensions to the shared format (all optional): a top-level ``comment`` string saying what
the scenario tests; ``reservations[].nodes`` pinning a reservation's pool to named nodes
(otherwise the loader picks whole nodes from the end of the topology, switch by switch);
``policy`` may also set any ``PlannerConfig`` knob except ``reclaim_mode``.

Teams (``teams[]``, a job's ``team``, a reservation's ``team``) are checked here once: names
unique, every ``parent`` a team and no cycle, every job's and reservation's ``team`` a team, a
reservation naming exactly one of ``job`` or ``team``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from jobs.planner.config import PlannerConfig
from jobs.planner.snapshot import PRIORITIES, CheckpointSpec, IdlePhase, Node


class ScenarioError(ValueError):
    """A scenario file problem; ``str()`` is ``where: what``."""

    def __init__(self, where: str, what: str) -> None:
        super().__init__(f"{where}: {what}" if where else what)
        self.where = where
        self.what = what


@dataclass(frozen=True, slots=True)
class JobSpec:
    """One job as the scenario declares it (defaults filled in)."""

    name: str
    priority: str
    dp: int
    global_batch: int
    micro_batch: int
    total_steps: int
    step_s: float
    owner: str = "anon"
    submit_s: float = 0.0
    tp: int = 1
    pp: int = 1
    dp_min: int = 0
    dp_max: int = 0
    step_cv: float = 0.02
    comm_fraction: float = 0.1
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    idle_phases: tuple[IdlePhase, ...] = ()
    min_run_s: float = 0.0
    team: str | None = None


@dataclass(frozen=True, slots=True)
class TeamSpec:
    """One team as declared: its quota, borrowing limit (``None``: no limit) and weight."""

    name: str
    parent: str | None = None
    quota_gpus: int = 0
    borrow_limit_gpus: int | None = None
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class ReservationSpec:
    """One reservation as declared, plus the pool nodes it was given. A team's reservation has
    ``team`` set and ``job`` empty: it guarantees whichever of the team's critical jobs runs."""

    name: str
    job: str
    gpus: int
    spares: int = 0
    start_s: float = 0.0
    end_s: float | None = None
    period_s: float | None = None
    active_s: float | None = None
    nodes: tuple[str, ...] = ()
    team: str | None = None


@dataclass(frozen=True, slots=True)
class EventSpec:
    """A fault or operator action at ``at_s``."""

    at_s: float
    kind: str
    node: str | None = None
    job: str | None = None
    factor: float | None = None


@dataclass(frozen=True, slots=True)
class Scenario:
    """A validated scenario."""

    name: str
    horizon_s: float
    seed: int
    nodes: tuple[Node, ...]
    jobs: tuple[JobSpec, ...]
    reservations: tuple[ReservationSpec, ...]
    events: tuple[EventSpec, ...]
    policy: dict[str, Any]
    comment: str = ""
    teams: tuple[TeamSpec, ...] = ()

    def planner_config(self, reclaim_mode: str = "graceful") -> PlannerConfig:
        """The planner config this scenario asks for."""
        return PlannerConfig(reclaim_mode=reclaim_mode).with_overrides(self.policy)

    @property
    def total_gpus(self) -> int:
        """GPUs in the cluster."""
        return sum(n.gpus for n in self.nodes)


TOP_KEYS = {"name", "horizon_s", "seed", "cluster", "jobs", "reservations", "events", "policy", "comment", "teams"}
REGULAR_KEYS = ("racks", "switches_per_rack", "nodes_per_switch", "gpus_per_node")
NODE_KEYS = {"name", "rack", "switch", "gpus"}
JOB_KEYS = {
    "name", "owner", "priority", "submit_s", "tp", "pp", "dp", "dp_min", "dp_max", "global_batch",
    "micro_batch", "total_steps", "step_s", "step_cv", "comm_fraction", "checkpoint", "idle_phases",
    "min_run_s", "team",
}
JOB_REQUIRED = ("name", "priority", "dp", "global_batch", "micro_batch", "total_steps", "step_s")
CHECKPOINT_KEYS = {"every_steps", "save_s", "load_s"}
IDLE_KEYS = {"every_steps", "duration_s"}
RES_KEYS = {"name", "job", "team", "gpus", "spares", "start_s", "end_s", "period_s", "active_s", "nodes"}
TEAM_KEYS = {"name", "parent", "quota_gpus", "borrow_limit_gpus", "weight"}
#: Policy knobs that must be strictly positive (a half-life of 0 would make no sense).
POSITIVE_POLICY_KEYS = {"fair_share_half_life_s"}
EVENT_FIELDS = {
    "node_down": ("node",),
    "node_up": ("node",),
    "slow_node": ("node", "factor"),
    "drain": ("node",),
    "cancel": ("job",),
}
POLICY_KEYS = {f.name for f in fields(PlannerConfig)} - {"reclaim_mode", "wall_clock_zone", "explain_holds"}


def _keys(obj: Any, where: str, allowed: set[str], required: tuple[str, ...] = ()) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ScenarioError(where, f"must be an object, got {type(obj).__name__}")
    for key in sorted(obj):
        if key not in allowed:
            raise ScenarioError(f"{where}.{key}" if where else key, "unknown key")
    for key in required:
        if key not in obj:
            raise ScenarioError(f"{where}.{key}" if where else key, "is required")
    return obj


def _int(value: Any, where: str, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ScenarioError(where, f"must be an integer, got {json.dumps(value)}")
    if minimum is not None and value < minimum:
        raise ScenarioError(where, f"must be at least {minimum}, got {value}")
    return value


def _num(value: Any, where: str, minimum: float | None = None, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ScenarioError(where, f"must be a number, got {json.dumps(value)}")
    value = float(value)
    if positive and value <= 0:
        raise ScenarioError(where, f"must be positive, got {value:g}")
    if minimum is not None and value < minimum:
        raise ScenarioError(where, f"must be at least {minimum:g}, got {value:g}")
    return value


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ScenarioError(where, f"must be a non-empty string, got {json.dumps(value)}")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ScenarioError(where, f"must be a list, got {type(value).__name__}")
    return value


def _cluster(obj: Any) -> tuple[Node, ...]:
    if not isinstance(obj, dict):
        raise ScenarioError("cluster", "must be an object")
    if "nodes" in obj:
        _keys(obj, "cluster", {"nodes"})
        nodes: list[Node] = []
        seen: set[str] = set()
        for i, raw in enumerate(_list(obj["nodes"], "cluster.nodes")):
            where = f"cluster.nodes[{i}]"
            _keys(raw, where, NODE_KEYS, ("name", "rack", "switch", "gpus"))
            name = _str(raw["name"], f"{where}.name")
            if name in seen:
                raise ScenarioError(f"{where}.name", f"duplicate node {name!r}")
            seen.add(name)
            nodes.append(Node(name, _str(raw["rack"], f"{where}.rack"), _str(raw["switch"], f"{where}.switch"),
                              _int(raw["gpus"], f"{where}.gpus", 1)))
        if not nodes:
            raise ScenarioError("cluster.nodes", "must list at least one node")
        return tuple(nodes)
    _keys(obj, "cluster", set(REGULAR_KEYS), REGULAR_KEYS)
    racks, switches, per_switch, gpus = (_int(obj[k], f"cluster.{k}", 1) for k in REGULAR_KEYS)
    return tuple(
        Node(f"r{r}s{s}n{n}", f"r{r}", f"r{r}s{s}", gpus)
        for r in range(racks)
        for s in range(switches)
        for n in range(per_switch)
    )


def _job(raw: Any, i: int, max_node_gpus: int, total_gpus: int, policy_min_run_s: float, horizon_s: float,
         teams: set[str]) -> JobSpec:
    where = f"jobs[{i}]"
    _keys(raw, where, JOB_KEYS, JOB_REQUIRED)
    name = _str(raw["name"], f"{where}.name")
    team = _team_ref(raw.get("team"), f"{where}.team", teams)
    priority = raw["priority"]
    if priority not in PRIORITIES:
        raise ScenarioError(f"{where}.priority", f"must be one of {', '.join(PRIORITIES)}, got {json.dumps(priority)}")
    tp = _int(raw.get("tp", 1), f"{where}.tp", 1)
    pp = _int(raw.get("pp", 1), f"{where}.pp", 1)
    if tp > max_node_gpus:
        raise ScenarioError(f"{where}.tp", f"{tp} exceeds gpus_per_node {max_node_gpus}")
    dp = _int(raw["dp"], f"{where}.dp", 1)
    dp_min = _int(raw.get("dp_min", dp), f"{where}.dp_min", 1)
    dp_max = _int(raw.get("dp_max", dp), f"{where}.dp_max", 1)
    if dp_min > dp:
        raise ScenarioError(f"{where}.dp_min", f"{dp_min} exceeds dp {dp}")
    if dp_max < dp:
        raise ScenarioError(f"{where}.dp_max", f"{dp_max} is below dp {dp}")
    micro = _int(raw["micro_batch"], f"{where}.micro_batch", 1)
    gb = _int(raw["global_batch"], f"{where}.global_batch", 1)
    if gb % (micro * dp):
        raise ScenarioError(f"{where}.global_batch", f"{gb} is not divisible by micro_batch*dp = {micro * dp}")
    if tp * pp * dp_min > total_gpus:
        raise ScenarioError(f"{where}.dp_min", f"needs {tp * pp * dp_min} GPUs but the cluster has {total_gpus}")
    total_steps = _int(raw["total_steps"], f"{where}.total_steps", 1)
    step_s = _num(raw["step_s"], f"{where}.step_s", positive=True)
    step_cv = _num(raw.get("step_cv", 0.02), f"{where}.step_cv", 0.0)
    comm = _num(raw.get("comm_fraction", 0.1), f"{where}.comm_fraction", 0.0)
    if comm > 1:
        raise ScenarioError(f"{where}.comm_fraction", f"must be at most 1, got {comm:g}")
    ckpt_raw = raw.get("checkpoint", {})
    _keys(ckpt_raw, f"{where}.checkpoint", CHECKPOINT_KEYS)
    ckpt = CheckpointSpec(
        every_steps=_int(ckpt_raw.get("every_steps", 500), f"{where}.checkpoint.every_steps", 1),
        save_s=_num(ckpt_raw.get("save_s", 30), f"{where}.checkpoint.save_s", 0.0),
        load_s=_num(ckpt_raw.get("load_s", 60), f"{where}.checkpoint.load_s", 0.0),
    )
    phases = []
    for k, p in enumerate(_list(raw.get("idle_phases", []), f"{where}.idle_phases")):
        pw = f"{where}.idle_phases[{k}]"
        _keys(p, pw, IDLE_KEYS, ("every_steps", "duration_s"))
        phases.append(IdlePhase(_int(p["every_steps"], f"{pw}.every_steps", 1), _num(p["duration_s"], f"{pw}.duration_s", 0.0)))
    default_min_run = policy_min_run_s if priority == "regular" else 0.0
    submit_s = _num(raw.get("submit_s", 0), f"{where}.submit_s", 0.0)
    return JobSpec(
        name=name, priority=priority, dp=dp, global_batch=gb, micro_batch=micro, total_steps=total_steps,
        step_s=step_s, owner=_str(raw.get("owner", "anon"), f"{where}.owner"), submit_s=submit_s,
        tp=tp, pp=pp, dp_min=dp_min, dp_max=dp_max, step_cv=step_cv, comm_fraction=comm,
        checkpoint=ckpt, idle_phases=tuple(phases),
        min_run_s=_num(raw.get("min_run_s", default_min_run), f"{where}.min_run_s", 0.0),
        team=team,
    )


def _team_ref(value: Any, where: str, teams: set[str]) -> str | None:
    """A reference to a team (absent or null: none), which must name one of ``teams``."""
    if value is None:
        return None
    name = _str(value, where)
    if name not in teams:
        raise ScenarioError(where, f"{name!r} is not a team")
    return name


def _teams(raw_list: Any) -> tuple[TeamSpec, ...]:
    """``teams[]``: unique names, parents that are teams, no cycle."""
    specs: list[TeamSpec] = []
    seen: set[str] = set()
    raws = _list(raw_list, "teams")
    for i, raw in enumerate(raws):
        where = f"teams[{i}]"
        _keys(raw, where, TEAM_KEYS, ("name",))
        name = _str(raw["name"], f"{where}.name")
        if name in seen:
            raise ScenarioError(f"{where}.name", f"duplicate team {name!r}")
        seen.add(name)
    for i, raw in enumerate(raws):
        where = f"teams[{i}]"
        limit = raw.get("borrow_limit_gpus")
        specs.append(TeamSpec(
            name=raw["name"],
            parent=_team_ref(raw.get("parent"), f"{where}.parent", seen),
            quota_gpus=_int(raw.get("quota_gpus", 0), f"{where}.quota_gpus", 0),
            borrow_limit_gpus=None if limit is None else _int(limit, f"{where}.borrow_limit_gpus", 0),
            weight=_num(raw.get("weight", 1), f"{where}.weight", positive=True),
        ))
    parent_of = {t.name: t.parent for t in specs}
    for i, t in enumerate(specs):
        path = [t.name]
        up = t.parent
        while up is not None:
            if up == t.name:
                raise ScenarioError(f"teams[{i}].parent", f"cycle: {' -> '.join([*path, up])}")
            if up in path:
                break  # a cycle further up: reported at its own team
            path.append(up)
            up = parent_of[up]
    return tuple(specs)


def _pick_pool(nodes: tuple[Node, ...], taken: set[str], want_gpus: int) -> tuple[str, ...]:
    """Whole nodes for a pool, from the end of the topology, filling one switch at a time."""
    by_switch: dict[tuple[str, str], list[Node]] = {}
    for n in nodes:
        if n.name not in taken:
            by_switch.setdefault((n.rack, n.switch), []).append(n)
    chosen: list[str] = []
    got = 0
    for key in sorted(by_switch, reverse=True):
        for n in sorted(by_switch[key], key=lambda n: n.name, reverse=True):
            if got >= want_gpus:
                break
            chosen.append(n.name)
            got += n.gpus
        if got >= want_gpus:
            break
    return tuple(sorted(chosen)) if got >= want_gpus else ()


def parse_scenario(data: Any) -> Scenario:
    """Validate a decoded scenario and build a ``Scenario`` (raises ``ScenarioError``)."""
    _keys(data, "", TOP_KEYS, ("name", "horizon_s", "cluster", "jobs"))
    name = _str(data["name"], "name")
    horizon_s = _num(data["horizon_s"], "horizon_s", positive=True)
    seed = _int(data.get("seed", 0), "seed")
    comment = data.get("comment", "")
    if not isinstance(comment, str):
        raise ScenarioError("comment", "must be a string")
    policy_raw = data.get("policy", {})
    _keys(policy_raw, "policy", POLICY_KEYS)
    policy: dict[str, Any] = {}
    for key, value in sorted(policy_raw.items()):
        default = getattr(PlannerConfig(), key)
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ScenarioError(f"policy.{key}", f"must be true or false, got {json.dumps(value)}")
            policy[key] = value
            continue
        policy[key] = _int(value, f"policy.{key}", 0) if isinstance(default, int) \
            else _num(value, f"policy.{key}", 0.0, positive=key in POSITIVE_POLICY_KEYS)
    config = PlannerConfig().with_overrides(policy)
    nodes = _cluster(data["cluster"])
    node_names = {n.name for n in nodes}
    max_node_gpus = max(n.gpus for n in nodes)
    total = sum(n.gpus for n in nodes)
    teams = _teams(data.get("teams", []))
    team_names = {t.name for t in teams}

    jobs: list[JobSpec] = []
    seen: set[str] = set()
    for i, raw in enumerate(_list(data["jobs"], "jobs")):
        job = _job(raw, i, max_node_gpus, total, config.min_run_s, horizon_s, team_names)
        if job.name in seen:
            raise ScenarioError(f"jobs[{i}].name", f"duplicate job {job.name!r}")
        seen.add(job.name)
        jobs.append(job)
    by_name = {j.name: j for j in jobs}

    reservations: list[ReservationSpec] = []
    taken: set[str] = set()
    res_seen: set[str] = set()
    for i, raw in enumerate(_list(data.get("reservations", []), "reservations")):
        where = f"reservations[{i}]"
        _keys(raw, where, RES_KEYS, ("name", "gpus"))
        rname = _str(raw["name"], f"{where}.name")
        if rname in res_seen:
            raise ScenarioError(f"{where}.name", f"duplicate reservation {rname!r}")
        res_seen.add(rname)
        if ("job" in raw) == ("team" in raw):
            raise ScenarioError(where, "needs exactly one of job or team" + (", not both" if "job" in raw else ""))
        gpus = _int(raw["gpus"], f"{where}.gpus", 1)
        rteam = None
        if "job" in raw:
            jname = _str(raw["job"], f"{where}.job")
            if jname not in by_name:
                raise ScenarioError(f"{where}.job", f"no job named {jname!r}")
            job = by_name[jname]
            if job.priority != "critical":
                raise ScenarioError(f"{where}.job", f"{jname!r} is {job.priority}; reservations guarantee critical jobs")
            owners = [job]
        else:
            jname = ""
            rteam = _team_ref(raw["team"], f"{where}.team", team_names)
            owners = [j for j in jobs if j.team == rteam and j.priority == "critical"]
        for job in owners:
            rep = job.tp * job.pp
            if gpus % rep:
                whose = "the job's" if rteam is None else f"{job.name!r}'s"
                raise ScenarioError(f"{where}.gpus", f"{gpus} is not a multiple of {whose} replica size {rep}")
        spares = _int(raw.get("spares", 0), f"{where}.spares", 0)
        start_s = _num(raw.get("start_s", 0), f"{where}.start_s", 0.0)
        end_s = _num(raw["end_s"], f"{where}.end_s") if raw.get("end_s") is not None else None
        if end_s is not None and end_s <= start_s:
            raise ScenarioError(f"{where}.end_s", f"{end_s:g} is not after start_s {start_s:g}")
        period = raw.get("period_s")
        active = raw.get("active_s")
        if (period is None) != (active is None):
            raise ScenarioError(f"{where}.{'active_s' if period is not None else 'period_s'}",
                                "period_s and active_s go together")
        period_s = _num(period, f"{where}.period_s", positive=True) if period is not None else None
        active_s = _num(active, f"{where}.active_s", positive=True) if active is not None else None
        if period_s is not None and active_s is not None and active_s > period_s:
            raise ScenarioError(f"{where}.active_s", f"{active_s:g} exceeds period_s {period_s:g}")
        if "nodes" in raw:
            pool = tuple(_str(n, f"{where}.nodes[{k}]") for k, n in enumerate(_list(raw["nodes"], f"{where}.nodes")))
            for k, n in enumerate(pool):
                if n not in node_names:
                    raise ScenarioError(f"{where}.nodes[{k}]", f"no node named {n!r}")
                if n in taken:
                    raise ScenarioError(f"{where}.nodes[{k}]", f"node {n!r} is already in another reservation")
            pool_gpus = sum(n.gpus for n in nodes if n.name in pool)
            if pool_gpus < gpus + spares:
                raise ScenarioError(f"{where}.nodes", f"pool has {pool_gpus} GPUs, needs gpus+spares = {gpus + spares}")
        else:
            pool = _pick_pool(nodes, taken, gpus + spares)
            if not pool:
                raise ScenarioError(f"{where}.gpus", f"gpus+spares = {gpus + spares} do not fit in the unreserved cluster")
        taken.update(pool)
        reservations.append(ReservationSpec(rname, jname, gpus, spares, start_s, end_s, period_s, active_s, pool, rteam))

    events: list[EventSpec] = []
    for i, raw in enumerate(_list(data.get("events", []), "events")):
        where = f"events[{i}]"
        if not isinstance(raw, dict):
            raise ScenarioError(where, "must be an object")
        kind = raw.get("kind")
        if kind not in EVENT_FIELDS:
            raise ScenarioError(f"{where}.kind", f"must be one of {', '.join(EVENT_FIELDS)}, got {json.dumps(kind)}")
        _keys(raw, where, {"at_s", "kind", *EVENT_FIELDS[kind]}, ("at_s", *EVENT_FIELDS[kind]))
        at_s = _num(raw["at_s"], f"{where}.at_s", 0.0)
        node = job_name = factor = None
        if "node" in EVENT_FIELDS[kind]:
            node = _str(raw["node"], f"{where}.node")
            if node not in node_names:
                raise ScenarioError(f"{where}.node", f"no node named {node!r}")
        if "job" in EVENT_FIELDS[kind]:
            job_name = _str(raw["job"], f"{where}.job")
            if job_name not in by_name:
                raise ScenarioError(f"{where}.job", f"no job named {job_name!r}")
        if "factor" in EVENT_FIELDS[kind]:
            factor = _num(raw["factor"], f"{where}.factor", positive=True)
        events.append(EventSpec(at_s, kind, node, job_name, factor))

    return Scenario(name, horizon_s, seed, nodes, tuple(jobs), tuple(reservations), tuple(events), policy, comment,
                    teams)


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file (raises ``ScenarioError`` with a one-line message)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ScenarioError(str(path), "no such file") from None
    except OSError as exc:
        raise ScenarioError(str(path), f"cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ScenarioError(str(path), "not UTF-8 text") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ScenarioError(str(path), f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    return parse_scenario(data)
