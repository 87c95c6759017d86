"""bench.faults' command check on its own: a command an agent applies and answers while the checker
reads the logs is not counted lost (the race behind a CI failure with every fault survived and
``commands_lost`` 1), and a command done with no agent ever applying it still is."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.utils import timezone

from bench.faults import REAL_NODES, SIMULATED_NODES, Checker, Role, Stack
from jobs.models import Command, Node
from jobs.models.commands import CommandState
from jobs.vocab import CommandKind


class AppliedWhileRead:
    """An agent log that the agent writes to, and answers a command through, while it is read:
    what the read returns is the file as it was before."""

    def __init__(self, path: Path, command: Command) -> None:
        self.path = path
        self.command = command
        self.name = path.name

    def read_text(self, errors: str = "strict") -> str:
        before = self.path.read_text(errors=errors)
        with self.path.open("a") as handle:
            handle.write(f"INFO node applying command {self.command.id} on s0: clean x (attempt 1)\n")
        Command.objects.filter(pk=self.command.pk).update(state=CommandState.DONE, finished_at=timezone.now())
        return before


def _checker(tmp_path: Path) -> Checker:
    stack = Stack(tmp_path, {})
    for node in REAL_NODES + SIMULATED_NODES:
        log = tmp_path / f"agent-{node}.1.log"
        log.write_text("")
        stack.roles[f"agent-{node}"] = Role(f"agent-{node}", [], {}, logs=[log])
    return Checker(stack)


def _command() -> Command:
    node = Node.objects.create(name="s0", rack="r0", switch="r0ss", gpu_count=2)
    return Command.objects.create(node=node, kind=CommandKind.CLEAN, payload={"job": "x"},
                                  state=CommandState.SENT, sent_at=timezone.now())


@pytest.mark.django_db
def test_a_command_applied_while_the_logs_are_read_is_not_counted_lost(tmp_path, monkeypatch):
    checker = _checker(tmp_path)
    command = _command()
    log = tmp_path / "agent-s0.1.log"
    racing = AppliedWhileRead(log, command)
    monkeypatch.setattr(checker, "agent_logs", lambda: [racing])
    assert [p for p in checker.problems() if p[0] == "commands_lost"] == []
    monkeypatch.setattr(checker, "agent_logs", lambda: [log])  # the next poll reads the line
    assert Command.objects.get(pk=command.pk).state == CommandState.DONE
    assert [p for p in checker.problems() if p[0] == "commands_lost"] == []
    assert checker.lost == set()


@pytest.mark.django_db
def test_a_command_done_that_no_agent_applied_is_counted_lost(tmp_path):
    checker = _checker(tmp_path)
    command = _command()
    Command.objects.filter(pk=command.pk).update(state=CommandState.DONE, finished_at=timezone.now())
    lost = [d for c, d in checker.problems() if c == "commands_lost"]
    assert len(lost) == 1 and "no agent ever applied it" in lost[0] and str(command.id) in lost[0]
    assert checker.lost == {str(command.id)}
