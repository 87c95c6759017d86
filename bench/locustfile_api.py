"""The API load of ``python -m bench.load``: researchers reading and writing through the REST API.

Run by bench.load as its own ``locust --headless`` process (locust monkeypatches the standard
library with gevent, so it is never imported into the bench process). Each simulated user signs
in with its own API token (``Authorization: Token``), talks to one of the ASGI servers (users
are dealt over them in turn), and mixes the reads a researcher's tools make (jobs list, a job's
detail, the nodes, the audit log, the teams) with writes (submit a job, cancel one of its own).

Configured by environment, written by bench.load:

``OMNI_LOAD_HOSTS``    comma-separated base URLs of the servers;
``OMNI_LOAD_TOKENS``   a JSON file: a list of API tokens, one per researcher;
``OMNI_LOAD_SAMPLES``  a file this process appends one JSON line per request to
                       (``name``, ``ms``, ``status``, ``error``), so bench.load computes exact
                       percentiles and counts every failure itself.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import uuid

from locust import HttpUser, between, events, task

HOSTS = [host for host in os.environ.get("OMNI_LOAD_HOSTS", "").split(",") if host]
with open(os.environ["OMNI_LOAD_TOKENS"]) as tokens_file:
    TOKENS: list[str] = json.load(tokens_file)
SAMPLES = open(os.environ["OMNI_LOAD_SAMPLES"], "a", buffering=1)  # noqa: SIM115 - open for the run
_seats = itertools.count()


@events.request.add_listener
def record(request_type, name, response_time, response_length, response=None, exception=None, **kwargs) -> None:
    status = getattr(response, "status_code", 0) or 0
    SAMPLES.write(json.dumps({"name": name, "ms": response_time, "status": status,
                              "error": repr(exception) if exception else ""}) + "\n")


class Researcher(HttpUser):
    """One researcher's client: reads often, submits now and then, cancels what it submitted."""

    wait_time = between(0.2, 1.0)

    def on_start(self) -> None:
        seat = next(_seats)
        self.base = HOSTS[seat % len(HOSTS)] if HOSTS else self.host
        self.client.headers["Authorization"] = f"Token {TOKENS[seat % len(TOKENS)]}"
        self.mine: list[int] = []  # job ids it reads in detail (its own)
        self.submitted: list[int] = []  # the ones it submitted in this run, oldest first: cancel's

    def _get(self, path: str, name: str):
        with self.client.get(f"{self.base}{path}", name=name, catch_response=True) as response:
            if response.status_code != 200:
                response.failure(f"{name}: HTTP {response.status_code}: {response.text[:200]}")
            return response

    @task(6)
    def jobs_list(self) -> None:
        response = self._get("/api/jobs/?limit=50&mine=true", "GET /api/jobs/")
        if response.ok and not self.mine:
            self.mine = [job["id"] for job in response.json()["results"]][:5]

    @task(4)
    def job_detail(self) -> None:
        if self.mine:
            self._get(f"/api/jobs/{random.choice(self.mine)}/", "GET /api/jobs/{id}/")

    @task(3)
    def cluster(self) -> None:
        self._get("/api/nodes/?limit=100", "GET /api/nodes/")

    @task(2)
    def events(self) -> None:
        self._get("/api/events/?limit=50", "GET /api/events/")

    @task(1)
    def teams(self) -> None:
        self._get("/api/teams/", "GET /api/teams/")

    @task(2)
    def submit(self) -> None:
        # Long and small: they queue and start on the virtual nodes, none finishes during the run,
        # so a later cancel always finds it unfinished.
        body = {"name": f"load-{uuid.uuid4().hex[:12]}", "priority": "best_effort", "dp": 1, "dp_min": 1,
                "dp_max": 2, "global_batch": 16, "micro_batch": 2, "total_steps": 1_000_000, "step_s": 1.0,
                "checkpoint_every_steps": 100, "checkpoint_save_s": 0.2, "checkpoint_load_s": 0.2}
        with self.client.post(f"{self.base}/api/jobs/", json=body, name="POST /api/jobs/",
                              catch_response=True) as response:
            if response.status_code != 201:
                response.failure(f"submit: HTTP {response.status_code}: {response.text[:200]}")
            else:
                self.submitted.append(response.json()["id"])
                self.mine.append(self.submitted[-1])

    @task(1)
    def cancel(self) -> None:
        if len(self.submitted) < 2:
            return
        job_id = self.submitted.pop(0)
        with self.client.post(f"{self.base}/api/jobs/{job_id}/cancel/", name="POST /api/jobs/{id}/cancel/",
                              catch_response=True) as response:
            if response.status_code != 200:
                response.failure(f"cancel: HTTP {response.status_code}: {response.text[:200]}")
