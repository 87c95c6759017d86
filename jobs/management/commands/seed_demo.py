"""``manage.py seed_demo``: a believable cluster with users for each role, an organisation with two
teams (docs/teams.md), jobs of every class and reservations, built through the real actions so
the audit log tells the story."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management.base import BaseCommand
from django.db import transaction
from django.utils import timezone

from jobs import actions
from jobs.models import Node, Priority
from jobs.roles import AUDITOR, OPERATOR, RESEARCHER

DEMO_PASSWORD = "omni-demo-pass"
DEMO_USERS = [
    ("alice", RESEARCHER, "Alice (researcher)"),
    ("bob", RESEARCHER, "Bob (researcher)"),
    ("olga", OPERATOR, "Olga (operator)"),
    ("audrey", AUDITOR, "Audrey (auditor)"),
]

# The organisation and its two teams: (name, parent, quota, borrowing limit) for the full demo
# cluster (256 GPUs), and for the story's 24 GPUs. There each team's quota covers all its jobs
# want (16 each, more than the cluster between them), so no team ever borrows beyond its quota,
# none reclaims from the other, and the story of the reserved window plays as it always has.
DEMO_ORG = "omni-lab"
DEMO_TEAMS = [(DEMO_ORG, None, 256, None), ("llm", DEMO_ORG, 128, 64), ("vision", DEMO_ORG, 96, 64)]
STORY_TEAMS = [(DEMO_ORG, None, 24, None), ("llm", DEMO_ORG, 16, None), ("vision", DEMO_ORG, 16, None)]
# Who is in which team, the first one their default (jobs without a team named go there).
DEMO_MEMBERS = {"olga": ["llm", "vision"], "bob": ["llm"], "alice": ["vision", "llm"]}
# Jobs submitted to another team than their owner's default one (an operator may submit to any).
DEMO_JOB_TEAMS = {"vlm-pretrain": "vision"}

# (name, owner, class, tp, pp, dp, dp_min, dp_max, global batch, micro batch, steps, step_s, place)
DEMO_JOBS = [
    ("omni-7b", "olga", Priority.CRITICAL, 8, 1, 4, 4, 4, 1024, 8, 200_000, 5.0, True),
    ("vlm-pretrain", "olga", Priority.CRITICAL, 8, 2, 2, 2, 2, 512, 4, 40_000, 6.0, False),
    ("sft-chat", "alice", Priority.REGULAR, 4, 1, 4, 2, 8, 128, 2, 5_000, 3.0, True),
    ("video-caption", "alice", Priority.REGULAR, 8, 1, 2, 1, 4, 256, 8, 12_000, 4.0, True),
    ("rlhf-reward", "bob", Priority.REGULAR, 2, 1, 4, 2, 8, 64, 2, 8_000, 1.5, False),
    ("ablation-lr", "bob", Priority.BEST_EFFORT, 8, 1, 2, 1, 4, 256, 4, 3_000, 4.0, True),
    ("ablation-vit", "alice", Priority.BEST_EFFORT, 4, 1, 2, 1, 4, 64, 4, 2_000, 2.0, False),
    ("debug-tokenizer", "bob", Priority.BEST_EFFORT, 1, 1, 1, 1, 2, 16, 8, 500, 0.8, False),
]


# The live story of ``make demo`` (docs/control-loop.md): a small cluster whose critical job's
# reserved GPUs are idle until its window opens a few minutes from now, so best-effort jobs
# borrow them, are preempted with a checkpoint ahead of the window, and resume afterwards.
# (name, owner, class, tp, pp, dp, dp_min, dp_max, global batch, micro batch, steps, step_s, ckpt every)
STORY_JOBS = [
    ("omni-7b", "olga", Priority.CRITICAL, 4, 1, 2, 2, 2, 16, 2, 120, 1.0, 20),
    # Regular jobs with slow steps: a loan into a 150 s window would not fit their start-up,
    # load, some steps and the save, so they take general capacity...
    ("sft-chat", "alice", Priority.REGULAR, 4, 1, 2, 1, 2, 64, 2, 100_000, 5.0, 10),
    ("video-caption", "alice", Priority.REGULAR, 4, 1, 1, 1, 1, 32, 4, 100_000, 6.0, 5),
    # ...and the quick best-effort ones overflow onto omni-7b's idle reserved GPUs.
    ("ablation-lr", "bob", Priority.BEST_EFFORT, 1, 1, 2, 1, 2, 16, 2, 100_000, 1.0, 10),
    ("ablation-vit", "alice", Priority.BEST_EFFORT, 1, 1, 2, 1, 2, 16, 2, 100_000, 1.0, 10),
    ("ablation-mix", "bob", Priority.BEST_EFFORT, 1, 1, 2, 1, 2, 16, 2, 100_000, 1.0, 10),
    ("debug-tokenizer", "bob", Priority.BEST_EFFORT, 1, 1, 1, 1, 1, 16, 2, 100_000, 1.0, 10),
]
STORY_WINDOW_IN_S = 150
# A researcher's own script with no Omni import (examples/signal_script/train.py), run by torchrun in
# signal mode: preempted with SIGTERM, it saves its own checkpoint within grace_s.
EXAMPLE_JOB = dict(
    name="ddp-example", priority=Priority.REGULAR, dp=2, global_batch=32, micro_batch=16, total_steps=100_000,
    step_s=1.0, entrypoint=[str(settings.BASE_DIR / "examples" / "signal_script" / "train.py"), "--step-s", "1.0"],
    integration="signal", grace_s=20.0,
)


class Command(BaseCommand):
    help = "Seed a demo cluster (4 racks x 2 switches x 4 nodes x 8 GPUs), users, jobs and reservations."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--racks", type=int, default=4)
        parser.add_argument("--switches-per-rack", type=int, default=2)
        parser.add_argument("--nodes-per-switch", type=int, default=4)
        parser.add_argument("--gpus-per-node", type=int, default=8)
        parser.add_argument("--story", action="store_true",
                            help="seed the live story of `make demo` instead: 2 racks x 3 nodes x 4 GPUs, nothing "
                            "placed (the planner places once agents connect), a reserved window a few minutes away")

    @transaction.atomic
    def handle(self, *args, racks: int, switches_per_rack: int, nodes_per_switch: int,
               gpus_per_node: int, story: bool = False, **options) -> None:
        if Node.objects.exists():
            self.stdout.write("seed_demo: the database already has a cluster; leaving it as it is.")
            self._print_logins()
            return
        if story:
            self._story()
            return
        users = self._users()
        teams = self._teams(users, DEMO_TEAMS)
        nodes = [
            Node(name=f"r{r}s{s}n{n}", rack=f"r{r}", switch=f"r{r}s{s}", gpu_count=gpus_per_node, gpu_model="H100-80GB")
            for r in range(racks) for s in range(switches_per_rack) for n in range(nodes_per_switch)
        ]
        Node.objects.bulk_create(nodes)
        nodes = list(Node.objects.order_by("name"))
        free = [(node, i) for node in nodes for i in range(node.gpu_count)]
        jobs = {}
        for name, owner, priority, tp, pp, dp, dp_min, dp_max, gb, mb, steps, step_s, place in DEMO_JOBS:
            job = actions.submit_job(
                users[owner], name=name, priority=priority, tp=tp, pp=pp, dp=dp, dp_min=dp_min, dp_max=dp_max,
                global_batch=gb, micro_batch=mb, total_steps=steps, step_s=step_s,
                **({"team": teams[DEMO_JOB_TEAMS[name]]} if name in DEMO_JOB_TEAMS else {}),
            )
            jobs[name] = job
            if place and len(free) >= job.gpus_wanted:
                gpus, free = free[: job.gpus_wanted], free[job.gpus_wanted:]
                actions.place_job(
                    job, gpus, actor="seed_demo",
                    reason={"rule": "seed", "text": f"Seeded as running on {job.gpus_wanted} GPUs.", "inputs": {}},
                )
        now = timezone.now().replace(second=0, microsecond=0)
        actions.create_reservation(
            users["olga"], name="omni-7b-hourly", job=jobs["omni-7b"], gpus=32, spares=8,
            start_at=now - timedelta(minutes=10), period_s=3600, active_s=2400,
        )
        actions.create_reservation(
            # The vision team's: whichever of its critical jobs runs (vlm-pretrain now), outliving it.
            users["olga"], name="vlm-window", team=teams["vision"], gpus=32,
            start_at=now + timedelta(hours=2), end_at=now + timedelta(hours=14),
        )
        self.stdout.write(
            f"seed_demo: {len(nodes)} nodes ({len(nodes) * gpus_per_node} GPUs), {len(jobs)} jobs, 2 reservations, "
            f"teams {', '.join(teams)}."
        )
        self._print_logins()

    def _story(self) -> None:
        users = self._users()
        teams = self._teams(users, STORY_TEAMS)
        nodes = [
            Node(name=f"r{r}s0n{n}", rack=f"r{r}", switch=f"r{r}s0", gpu_count=4, gpu_model="H100-80GB")
            for r in range(2) for n in range(3)
        ]
        Node.objects.bulk_create(nodes)
        jobs = {}
        for name, owner, priority, tp, pp, dp, dp_min, dp_max, gb, mb, steps, step_s, every in STORY_JOBS:
            jobs[name] = actions.submit_job(
                users[owner], name=name, priority=priority, tp=tp, pp=pp, dp=dp, dp_min=dp_min, dp_max=dp_max,
                global_batch=gb, micro_batch=mb, total_steps=steps, step_s=step_s, checkpoint_every_steps=every,
                checkpoint_save_s=2.0, checkpoint_load_s=3.0, min_run_s=0 if priority != Priority.REGULAR else None,
            )
        jobs["ddp-example"] = actions.submit_job(users["bob"], **EXAMPLE_JOB)
        actions.create_reservation(
            users["olga"], name="omni-7b-window", job=jobs["omni-7b"], gpus=8,
            start_at=timezone.now() + timedelta(seconds=STORY_WINDOW_IN_S), period_s=1800, active_s=600,
        )
        self.stdout.write(
            f"seed_demo --story: 6 nodes (24 GPUs), {len(jobs)} jobs in teams {', '.join(teams)}; omni-7b's reserved "
            f"window opens in {STORY_WINDOW_IN_S}s."
        )
        self._print_logins()

    def _users(self) -> dict:
        User = get_user_model()
        users = {}
        for username, role, full_name in DEMO_USERS:
            user, created = User.objects.get_or_create(
                username=username, defaults={"first_name": full_name, "is_staff": role == OPERATOR}
            )
            if created:
                user.set_password(DEMO_PASSWORD)
                user.save(update_fields=["password"])
            user.groups.add(Group.objects.get(name=role))
            users[username] = user
        return users

    def _teams(self, users: dict, spec: list[tuple[str, str | None, int, int | None]]) -> dict:
        """The organisation and its teams, and who is in them, through the audited actions."""
        teams: dict = {}
        for name, parent, quota, limit in spec:
            teams[name] = actions.create_team(users["olga"], name=name, parent=teams.get(parent) if parent else None,
                                              quota_gpus=quota, borrow_limit_gpus=limit)
        for username, names in DEMO_MEMBERS.items():
            for name in names:
                actions.add_team_member(teams[name], users["olga"], users[username])
        return teams

    def _print_logins(self) -> None:
        logins = ", ".join(f"{name} ({role})" for name, role, _ in DEMO_USERS)
        self.stdout.write(f"Demo logins: {logins}; password for all: {DEMO_PASSWORD}")
