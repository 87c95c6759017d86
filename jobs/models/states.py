"""Guarded state machines shared by the models: one table of legal moves per status field."""

from __future__ import annotations

from collections.abc import Mapping


class IllegalTransition(Exception):
    """A status change that the model's state machine does not allow (the API answers 409)."""

    def __init__(self, model: str, name: str, current: str, target: str, allowed: frozenset[str]):
        current, target = str(current), str(target)  # TextChoices members print as their value
        allowed = frozenset(str(state) for state in allowed)
        self.model = model
        self.name = name
        self.current = current
        self.target = target
        self.allowed = allowed
        allowed_text = ", ".join(sorted(allowed)) or "nothing (terminal state)"
        super().__init__(
            f"{model} {name!r} cannot go from {current!r} to {target!r}; "
            f"from {current!r} it may go to: {allowed_text}"
        )


class BatchInvariantError(ValueError):
    """``micro_batch * dp * accum_steps`` does not equal ``global_batch``."""


def check_transition(
    table: Mapping[str, frozenset[str]], model: str, name: str, current: str, target: str
) -> None:
    """Raise :class:`IllegalTransition` unless ``current -> target`` is in ``table``."""
    allowed = table.get(current, frozenset())
    if target not in allowed:
        raise IllegalTransition(model, name, current, target, allowed)
