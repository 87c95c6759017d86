"""``manage.py add_node NAME --rack R --switch S --gpus N [--gpu-model M]``: register a node
(audited, through ``register_node``) and say how to give its agent a token."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandParser

from jobs import actions
from jobs.management.commands._operator import OperatorCommand


class Command(OperatorCommand):
    help = "Register a GPU node, healthy and empty; its agent then needs a token (issue_agent_token)."
    field_options = {"gpu_count": "--gpus", "gpu_model": "--gpu-model", "rack": "--rack", "switch": "--switch"}

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="node name, as its agent will send it (e.g. r0s0n0)")
        parser.add_argument("--rack", required=True)
        parser.add_argument("--switch", required=True, help="leaf switch; nodes on one switch are closest")
        parser.add_argument("--gpus", type=int, required=True, help="number of GPUs")
        parser.add_argument("--gpu-model", default="H100-80GB", help="GPU model (default H100-80GB)")

    def handle(self, *args: Any, name: str, rack: str, switch: str, gpus: int, gpu_model: str,
               **options: Any) -> None:
        node = actions.register_node(None, name=name, rack=rack, switch=switch, gpu_count=gpus,
                                     gpu_model=gpu_model)
        self.stdout.write(
            f"Registered node {node.name}: {node.gpu_count}x {node.gpu_model} in rack {node.rack}, "
            f"switch {node.switch} ({node.state}).\n"
            f"Its agent needs a token: manage.py issue_agent_token {node.name}"
        )
