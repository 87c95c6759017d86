"""What an operator's edit of a node or a job shares: the edited copy, checked like the row it
will become; the before and after that its audit row and sentence carry; and a wait for the
planner, so that no pass plans on the old values while the edit commits."""

from __future__ import annotations

import copy
from typing import Any

from django.core.exceptions import ValidationError
from django.db import connection
from django.db.models import Model

from jobs.actions.planner_pass import PLANNER_LOCK_KEY

FieldErrors = dict[str, list[str]]


def with_changes(row: Model, changes: dict[str, Any]) -> Model:
    """A copy of ``row`` with ``changes`` set; ``row`` itself is left as it was."""
    edited = copy.copy(row)
    for field, value in changes.items():
        setattr(edited, field, value)
    return edited


def refuse_invalid(edited: Model, errors: FieldErrors) -> None:
    """Raise ``errors`` if there are any; else run the model's own checks (fields, ``clean()``,
    uniqueness, constraints) on the edited copy, so nothing reaches the database to be refused."""
    if not errors:
        try:
            edited.full_clean()
        except ValidationError as exc:
            errors = exc.message_dict
    if errors:
        raise ValidationError(errors)


def refuse_fields(changes: dict[str, Any], allowed: tuple[str, ...]) -> FieldErrors:
    """One error for each changed field the operator may not change."""
    return {field: ["this field cannot be changed here"] for field in sorted(set(changes) - set(allowed))}


def _plain(value: Any) -> Any:
    # Audit inputs are JSON: a related row (a job's owner) is recorded by its name.
    return str(value) if isinstance(value, Model) else value


def changed_facts(row: Model, edited: Model, fields: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fields whose values differ, before and after, in the audit row's terms."""
    changed = [field for field in fields if getattr(row, field) != getattr(edited, field)]
    return ({field: _plain(getattr(row, field)) for field in changed},
            {field: _plain(getattr(edited, field)) for field in changed})


def wait_for_planner() -> None:
    """Wait for a running planner pass, and keep the next one out until this transaction ends,
    so no pass plans with values the edit is changing. (SQLite: writers are serialised already.)"""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [PLANNER_LOCK_KEY])
