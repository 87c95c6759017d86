"""The planner's input: a frozen, plain-data picture of the cluster at one instant.

Everything here is an immutable dataclass (or, for the two tiny hot types ``Gpu`` and
``Holding``, a ``NamedTuple``) with no Django in sight, so the same snapshot can be built
from database rows in production and from the simulator's state in ``jobs.simulator``.
``to_dict`` / ``from_dict`` round-trip every type through JSON-able dicts.

Times are float seconds on one clock: scenario seconds in the simulator, Unix epoch seconds
in production. Nothing here assumes the clock starts at zero.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any, NamedTuple

from jobs.planner.kept import KeptById

PRIORITIES = ("critical", "regular", "best_effort")
#: Lower rank = more important. Used for ordering queues and choosing victims.
PRIORITY_RANK = {"critical": 0, "regular": 1, "best_effort": 2}

NODE_HEALTH = ("healthy", "suspect", "failed", "cordoned", "draining")
#: Health values on which new work may be placed.
PLACEABLE_HEALTH = frozenset({"healthy", "suspect"})

#: The Django Job state machine's values, shared so a snapshot maps 1:1 from rows.
JOB_PHASES = (
    "pending",
    "running",
    "checkpointing",
    "preempted",
    "resizing",
    "recovering",
    "completed",
    "failed",
    "cancelled",
)
TERMINAL_PHASES = frozenset({"completed", "failed", "cancelled"})
#: Phases in which a job waits for GPUs and holds none (``recovering`` may hold survivors).
WAITING_PHASES = frozenset({"pending", "preempted"})

RHYTHM_WINDOW = 200


class Gpu(NamedTuple):
    """One GPU, addressed by its node name and its index on that node."""

    node: str
    index: int

    def label(self) -> str:
        """``node:index``, the form used in audit records."""
        return f"{self.node}:{self.index}"


class Holding(NamedTuple):
    """One GPU a job holds; ``borrowed_from`` names the reservation it is lent from, if any."""

    gpu: Gpu
    borrowed_from: str | None = None


@dataclass(frozen=True, slots=True)
class Node:
    """A machine: its place in the topology, its GPU count, its health and measured speed.

    ``speed_factor`` is how much slower than nominal its steps run (1.0 nominal, 1.5 means
    steps take 1.5x as long); production derives it from per-rank step times. ``low_disk``: its
    agent's runs dir has less free space than the minimum (``disk_free_bytes``, as last
    reported; None: never reported), so nothing new is placed there while what runs there stays
    (production sets it from ``OMNI_MIN_FREE_DISK_BYTES``; the simulator never does).
    """

    name: str
    rack: str
    switch: str
    gpus: int
    health: str = "healthy"
    speed_factor: float = 1.0
    low_disk: bool = False
    disk_free_bytes: int | None = None

    @property
    def takes_new_work(self) -> bool:
        """Whether GPUs here may be given to a job now: placeable health and room on its disk."""
        return self.health in PLACEABLE_HEALTH and not self.low_disk


@dataclass(frozen=True, slots=True)
class CheckpointSpec:
    """How often a job checkpoints and what a save and a load cost, as declared."""

    every_steps: int = 500
    save_s: float = 30.0
    load_s: float = 60.0


@dataclass(frozen=True, slots=True)
class IdlePhase:
    """After every ``every_steps`` committed steps the job spends ``duration_s`` off its GPUs
    (after steps ``offset_steps``, ``offset_steps + every_steps``, ...; a measured phase may not
    fall on multiples of its period)."""

    every_steps: int
    duration_s: float
    offset_steps: int = 0

    def next_after(self, step: int) -> int:
        """The first step after ``step`` that this phase follows."""
        every = max(1, self.every_steps)
        return ((step - self.offset_steps) // every + 1) * every + self.offset_steps


@dataclass(frozen=True, slots=True)
class Rhythm:
    """What has been measured about a job: recent step times and save/load durations.

    ``step_s`` is a ring of at most ``RHYTHM_WINDOW`` recent step times measured at the job's
    current data-parallel size; ``save_s``/``load_s`` are recent measured checkpoint costs.
    """

    step_s: tuple[float, ...] = ()
    save_s: tuple[float, ...] = ()
    load_s: tuple[float, ...] = ()


#: (holdings tuple, its GPUs), for ``Job.gpus``, which every rule asks for over and over: a job's
#: GPUs are listed once per layout (``kept``).
_GPUS_OF = KeptById()
_GPUS_OF_MAX = 1 << 16


@dataclass(frozen=True, slots=True)
class Job:
    """A training job: its spec, its layout and progress now, and its measured rhythm.

    The current data-parallel size is ``len(holdings) // (tp * pp)``; ``holdings`` lists the
    GPUs it holds now (in replica order: each run of ``tp`` GPUs is one TP group, each run of
    ``tp * pp`` one replica). ``idle_until_s`` is set while the job is in a known idle phase
    (evaluation on CPU, data stall); ``parked`` lists the GPUs it lent out for that phase and
    is owed back when the phase ends.

    ``integration`` is how its code works with Omni: ``omni`` (the runtime library: cooperative
    checkpoint-and-stop, elastic) or ``signal`` (any script: SIGTERM, ``grace_s`` to exit, then
    SIGKILL; never resized or moved, and its checkpoints are invisible to the planner).
    """

    name: str
    priority: str
    tp: int
    pp: int
    dp: int
    dp_min: int
    dp_max: int
    global_batch: int
    micro_batch: int
    total_steps: int
    step_s: float
    comm_fraction: float = 0.1
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    idle_phases: tuple[IdlePhase, ...] = ()
    min_run_s: float = 0.0
    submit_s: float = 0.0
    owner: str = "anon"
    phase: str = "pending"
    committed_steps: int = 0
    last_checkpoint_step: int = 0
    last_checkpoint_s: float | None = None
    run_started_s: float | None = None
    last_resize_s: float | None = None
    queued_since_s: float | None = None
    holdings: tuple[Holding, ...] = ()
    rhythm: Rhythm = field(default_factory=Rhythm)
    preemptions: int = 0
    idle_until_s: float | None = None
    parked: tuple[Gpu, ...] = ()
    integration: str = "omni"
    grace_s: float = 30.0
    #: The team it belongs to (``Snapshot.teams``); ``None``: no quota, it only borrows.
    team: str | None = None

    @property
    def signal(self) -> bool:
        """A signal-mode job: stopped by SIGTERM and ``grace_s``, not elastic, saves unseen."""
        return self.integration == "signal"

    @property
    def replica_gpus(self) -> int:
        """GPUs in one data-parallel replica (``tp * pp``)."""
        return self.tp * self.pp

    @property
    def current_dp(self) -> int:
        """Replicas held now."""
        return len(self.holdings) // (self.tp * self.pp)

    @property
    def gpus(self) -> tuple[Gpu, ...]:
        """The GPUs held now, in replica order."""
        held = self.holdings
        if not held:
            return ()
        hit = _GPUS_OF.get(id(held))
        if hit is not None and hit[0] is held:
            return hit[1]
        if len(_GPUS_OF) >= _GPUS_OF_MAX:
            _GPUS_OF.clear()
        return _GPUS_OF.keep(held, tuple(h.gpu for h in held))[1]

    @property
    def remaining_steps(self) -> int:
        """Steps still to commit."""
        return max(0, self.total_steps - self.committed_steps)


@dataclass(frozen=True, slots=True)
class Team:
    """Who shares the cluster: a guaranteed quota of GPUs, how many more it may borrow while
    others' are idle (``None``: no limit), its weight among borrowers, and its past usage.

    ``usage_gpu_s`` is the team's GPU-seconds decayed with the policy's
    ``fair_share_half_life_s`` up to the snapshot's instant (``quota.decayed``; the snapshot's
    builder keeps it). ``parent`` names the enclosing team (an organisation): a child's jobs
    count against its parent's quota and borrowing limit too.
    """

    name: str
    parent: str | None = None
    quota_gpus: int = 0
    borrow_limit_gpus: int | None = None
    weight: float = 1.0
    usage_gpu_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Reservation:
    """Guaranteed capacity for one critical job, or for a team's critical jobs.

    Active from ``start_s`` to ``end_s`` (``None``: open-ended); if ``period_s`` is set, only
    for the first ``active_s`` of every ``period_s`` from ``start_s``. ``nodes`` is the pool
    of machines that holds its ``gpus`` plus ``spares`` (chosen by the operator, or by the
    simulator's loader); an empty pool means the guarantee is met from general capacity.
    A team's reservation (``team`` set, ``job`` empty) guarantees its GPUs to whichever of the
    team's critical jobs is runnable, the earliest submitted first (the pass resolves it), and
    outlives any one of them.
    """

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
class Command:
    """A command already sent to a job's agent and not yet acknowledged as done.

    ``releases`` lists the GPUs the job will give back once the command completes (all of
    them for a preemption, the dropped replicas for a shrink), so a pass can count them as
    on their way instead of taking more victims.
    """

    id: str
    job: str
    kind: str
    deadline_s: float | None = None
    releases: tuple[Gpu, ...] = ()


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The whole picture one planner pass decides from."""

    nodes: tuple[Node, ...]
    jobs: tuple[Job, ...]
    reservations: tuple[Reservation, ...] = ()
    commands: tuple[Command, ...] = ()
    paused: bool = False
    teams: tuple[Team, ...] = ()


# --- serialization ---------------------------------------------------------------------------


_NAME = attrgetter("name")
_PHASE = attrgetter("phase")
_HOLDINGS = attrgetter("holdings")


def holding_gpus(jobs: Iterable[Job]) -> Iterator[Job]:
    """The jobs of ``jobs`` that hold GPUs, in order: picked out without a Python-level step per
    job (most of a long queue holds nothing)."""
    return filter(_HOLDINGS, jobs)


#: A jobs tuple and its ``live_jobs_by_name``, as the snapshot's builder already had them (the
#: simulator keeps its active jobs in name order): one slot, read as one tuple, taken only for
#: that very tuple (the slot keeps it, so its identity is not reused while it stands).
_NOTED: tuple[tuple[Job, ...], dict[str, Job]] | None = None


def note_live_jobs_by_name(jobs: tuple[Job, ...], by_name: dict[str, Job]) -> None:
    """Say that ``by_name`` is ``live_jobs_by_name(jobs)``, so a pass on ``jobs`` copies it."""
    global _NOTED
    _NOTED = (jobs, by_name)


def live_jobs_by_name(jobs: Iterable[Job]) -> dict[str, Job]:
    """The jobs not over yet (``TERMINAL_PHASES``), by name in name order: every pass's index of
    its snapshot's jobs (built without a Python-level step per job, as a long queue asks; a copy
    of what ``note_live_jobs_by_name`` noted for this very tuple)."""
    noted = _NOTED
    if noted is not None and noted[0] is jobs:
        return dict(noted[1])
    return built_live_jobs_by_name(jobs)


def built_live_jobs_by_name(jobs: Iterable[Job]) -> dict[str, Job]:
    """``live_jobs_by_name`` worked out from the jobs themselves."""
    ordered = sorted(jobs, key=_NAME)
    if not TERMINAL_PHASES.isdisjoint(map(_PHASE, ordered)):
        ordered = [j for j in ordered if j.phase not in TERMINAL_PHASES]
    return dict(zip(map(_NAME, ordered), ordered, strict=True))


def _plain(value: Any) -> Any:
    if isinstance(value, Gpu):
        return [value.node, value.index]
    if isinstance(value, Holding):
        return {"gpu": [value.gpu.node, value.gpu.index], "borrowed_from": value.borrowed_from}
    if hasattr(value, "__dataclass_fields__"):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def to_dict(obj: Any) -> Any:
    """A JSON-able rendering of any snapshot or plan object (dataclasses become dicts)."""
    return _plain(obj)


def gpu_from(value: Any) -> Gpu:
    """A ``Gpu`` from ``[node, index]``, ``{"node":..,"index":..}`` or ``"node:index"``."""
    if isinstance(value, Gpu):
        return value
    if isinstance(value, str):
        node, _, index = value.rpartition(":")
        return Gpu(node, int(index))
    if isinstance(value, dict):
        return Gpu(value["node"], int(value["index"]))
    return Gpu(str(value[0]), int(value[1]))


def holding_from(value: Any) -> Holding:
    """A ``Holding`` from its dict form (or a bare GPU form, meaning not borrowed)."""
    if isinstance(value, Holding):
        return value
    if isinstance(value, dict) and "gpu" in value:
        return Holding(gpu_from(value["gpu"]), value.get("borrowed_from"))
    return Holding(gpu_from(value), None)


def node_from_dict(d: dict[str, Any]) -> Node:
    """Build a ``Node`` from its ``to_dict`` form."""
    return Node(**d)


def job_from_dict(d: dict[str, Any]) -> Job:
    """Build a ``Job`` from its ``to_dict`` form."""
    d = dict(d)
    if isinstance(d.get("checkpoint"), dict):
        d["checkpoint"] = CheckpointSpec(**d["checkpoint"])
    d["idle_phases"] = tuple(
        p if isinstance(p, IdlePhase) else IdlePhase(**p) for p in d.get("idle_phases", ())
    )
    d["holdings"] = tuple(holding_from(h) for h in d.get("holdings", ()))
    d["parked"] = tuple(gpu_from(g) for g in d.get("parked", ()))
    rhythm = d.get("rhythm")
    if isinstance(rhythm, dict):
        d["rhythm"] = Rhythm(**{k: tuple(v) for k, v in rhythm.items()})
    return Job(**d)


def reservation_from_dict(d: dict[str, Any]) -> Reservation:
    """Build a ``Reservation`` from its ``to_dict`` form."""
    d = dict(d)
    d["nodes"] = tuple(d.get("nodes", ()))
    return Reservation(**d)


def snapshot_from_dict(d: dict[str, Any]) -> Snapshot:
    """Build a ``Snapshot`` from its ``to_dict`` form."""
    return Snapshot(
        nodes=tuple(node_from_dict(n) for n in d["nodes"]),
        jobs=tuple(job_from_dict(j) for j in d["jobs"]),
        reservations=tuple(reservation_from_dict(r) for r in d.get("reservations", ())),
        commands=tuple(
            Command(**{**c, "releases": tuple(gpu_from(g) for g in c.get("releases", ()))})
            for c in d.get("commands", ())
        ),
        paused=bool(d.get("paused", False)),
        teams=tuple(Team(**t) for t in d.get("teams", ())),
    )
