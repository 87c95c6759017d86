"""Schemathesis over the real ASGI server (``manage.py serve --no-loop`` on the test database):
every operation of ``/api/schema/`` as each role, as a user with none and as a node agent, with
cases generated from the schema, positive and negative, against rows that exist.

Every answer must be no 5xx and exactly what the schema says (status code, content type, headers,
body). The run prints its seed; ``OMNI_FUZZ_SEED`` replays one, ``OMNI_FUZZ_CASES`` runs longer
(docs/api.md, "Fuzzing"). Failures are collected over the whole run and reported together, each
with the curl line that reproduces it.
"""

from __future__ import annotations

import math
import os
import random
import zlib
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import hypothesis
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.live.server import database_url, serve

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
MIN_CASES = 1000
CASES = int(os.environ.get("OMNI_FUZZ_CASES") or 1200)
MISSING_ID = 987654321  # a row that does not exist: the 404 of every detail route
MAX_FAILURES_SHOWN = 20


@dataclass
class Identity:
    """Who sends a case: its headers, and which operations it fuzzes."""

    name: str
    headers: dict[str, str]
    agent: bool = False


@dataclass
class Tally:
    cases: int = 0
    operations: set[str] = field(default_factory=set)
    statuses: Counter[int] = field(default_factory=Counter)
    failures: dict[str, str] = field(default_factory=dict)  # one example per identity, operation and check


def _first_lines(text: str, lines: int = 6, width: int = 300) -> str:
    return "\n    ".join(line[:width] for line in text.strip().splitlines()[:lines])


def _seed_cluster() -> tuple[list[Identity], dict[str, list[Any]]]:
    """Users of every role with API tokens, a node agent, and rows for every path parameter,
    made through the real actions."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group
    from django.utils import timezone

    from jobs import actions
    from jobs.actions.accounts import issue_api_token
    from jobs.models import ElasticEvent, Node
    from jobs.roles import AUDITOR, OPERATOR, RESEARCHER

    users = {}
    for username, role in [("rita", RESEARCHER), ("olive", OPERATOR), ("aud", AUDITOR), ("otto", None)]:
        user = get_user_model().objects.create_user(username=username, password=f"{username}-pass-1234")
        if role is not None:
            user.groups.add(Group.objects.get_or_create(name=role)[0])
        users[username] = user
    operator, researcher = users["olive"], users["rita"]

    Node.objects.bulk_create(
        Node(name=f"r0s{s}n{n}", rack="r0", switch=f"r0s{s}", gpu_count=8) for s in range(2) for n in range(2)
    )
    agent_node = Node.objects.order_by("name").first()
    agent_token = agent_node.issue_token()
    agent_node.save(update_fields=["agent_token_hash"])

    ml = actions.create_team(operator, name="ml", quota_gpus=16)
    vision = actions.create_team(operator, name="vision", parent=ml, quota_gpus=8)
    actions.add_team_member(ml, operator, researcher, default=True)
    actions.add_team_member(vision, operator, researcher)
    spec = dict(dp=2, dp_min=1, dp_max=4, global_batch=64, micro_batch=4, total_steps=1000, step_s=1.0)
    jobs = [
        actions.submit_job(researcher, name="sft-a", priority="regular", **spec),
        actions.submit_job(researcher, name="sft-b", priority="best_effort", team=vision, **spec),
        actions.submit_job(operator, name="crit", priority="critical", team=None, **spec),
    ]
    reservation = actions.create_reservation(operator, name="window", job=jobs[2], gpus=8,
                                             start_at=timezone.now(), end_at=timezone.now() + timedelta(hours=1))
    team_reservation = actions.create_reservation(operator, name="team-window", team=ml, gpus=4,
                                                  start_at=timezone.now() + timedelta(days=1))
    ids = {
        "jobs": [job.pk for job in jobs],
        "nodes": list(Node.objects.values_list("pk", flat=True)),
        "reservations": [reservation.pk, team_reservation.pk],
        "teams": [ml.pk, vision.pk],
        "events": list(ElasticEvent.objects.order_by("id").values_list("pk", flat=True)[:5]),
        "username": list(users),
    }
    identities = [
        Identity(username, {"Authorization": f"Token {issue_api_token(None, user, label='fuzz')[1]}"})
        for username, user in users.items()
    ]
    identities.append(Identity(
        "agent", {"Authorization": f"Bearer {agent_token}", "X-Omni-Node": agent_node.name}, agent=True,
    ))
    return identities, ids


def _path_parameters(operation, ids: dict[str, list[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """Path parameters that name seeded rows (and one that does not): ids cannot be guessed."""
    resource = operation.path.split("/")[2]
    parameters = {}
    for parameter in operation.path_parameters:
        pool = ids["username"] if parameter.name == "username" else ids[resource]
        parameters[parameter.name] = st.sampled_from([*pool, MISSING_ID if parameter.name == "id" else "nobody"])
    return st.fixed_dictionaries(parameters)


def _cases(operation, ids: dict[str, list[Any]]) -> st.SearchStrategy:
    modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
    if not operation.path_parameters:
        return st.one_of(*(operation.as_strategy(generation_mode=mode) for mode in modes))
    return _path_parameters(operation, ids).flatmap(
        lambda path: st.one_of(*(operation.as_strategy(generation_mode=mode, path_parameters=path) for mode in modes))
    )


def _fuzz(operation, identity: Identity, ids, base_url: str, session: requests.Session, seed: int,
          max_examples: int, tally: Tally) -> None:
    label = f"{operation.method.upper()} {operation.path}"

    @hypothesis.seed(zlib.crc32(f"{seed}:{identity.name}:{label}".encode()))
    @hypothesis.settings(
        max_examples=max_examples, database=None, deadline=None, derandomize=False,
        phases=[Phase.generate], suppress_health_check=list(HealthCheck),
    )
    @given(case=_cases(operation, ids))
    def run(case) -> None:
        tally.cases += 1
        response = case.call(base_url=base_url, session=session, headers=identity.headers, timeout=30)
        tally.statuses[response.status_code] += 1
        try:
            case.validate_response(response, checks=CHECKS)
        except (Failure, FailureGroup) as caught:  # a group holds every failed check of the case
            for failure in caught.exceptions if isinstance(caught, FailureGroup) else [caught]:
                key = f"[{identity.name}] {label}: {failure.title}"
                if key not in tally.failures:
                    tally.failures[key] = (
                        f"{key} ({response.status_code})\n    {_first_lines(str(failure))}\n"
                        f"    reproduce: {case.as_curl_command(headers=identity.headers)}"
                    )

    run()
    tally.operations.add(label)


def _say(capsys, line: str) -> None:
    """Into the test output even when pytest captures it: the seed and the counts are the record."""
    with capsys.disabled():
        print(line, flush=True)


def test_the_api_answers_every_generated_case_as_its_schema_says(transactional_db, django_db_blocker, capsys):
    # A new seed every run, as a fuzzer is meant to run; OMNI_FUZZ_SEED replays one.
    chosen = os.environ.get("OMNI_FUZZ_SEED")
    seed = int(chosen) if chosen else random.randrange(2**32)
    _say(capsys, f"\nschemathesis: seed {seed} (OMNI_FUZZ_SEED={seed} replays this run)")
    identities, ids = _seed_cluster()
    with serve({"DATABASE_URL": database_url(django_db_blocker)}, "fuzz-server.log") as base_url:
        schema = schemathesis.openapi.from_url(f"{base_url}/api/schema/")
        operations = [result.ok() for result in schema.get_all_operations()]
        # Destructive writes last, so reads and edits meet the seeded rows first.
        operations.sort(key=lambda op: (op.method.upper() == "DELETE", op.method.upper() != "GET", op.path))
        pairs = [
            (operation, identity) for operation in operations for identity in identities
            if operation.path.startswith("/api/telemetry/") == identity.agent
        ]
        per_pair = math.ceil(CASES / len(pairs))
        tally = Tally()
        with requests.Session() as session:
            for operation, identity in pairs:
                _fuzz(operation, identity, ids, base_url, session, seed, per_pair, tally)
    _say(capsys, f"schemathesis: {tally.cases:,} cases over {len(tally.operations)} operations, "
                 f"{len(identities)} identities, {len(tally.failures)} failures (seed {seed})")
    _say(capsys, "schemathesis: answers " + ", ".join(f"{code}: {n}" for code, n in sorted(tally.statuses.items())))
    assert not tally.failures, (
        f"{len(tally.failures)} kinds of failure (seed {seed}), the first {MAX_FAILURES_SHOWN}:\n"
        + "\n".join(list(tally.failures.values())[:MAX_FAILURES_SHOWN])
    )
    assert len(tally.operations) == len(operations)
    assert tally.cases >= MIN_CASES, f"only {tally.cases} cases generated; the run must make at least {MIN_CASES}"
