"""``GET /api/jobs/{id}/logs/``: a job's lines oldest first, filtered by rank and stream, paged by
id, for those who see the job in full; a 400 names the parameter that is wrong."""

from __future__ import annotations

import time

import pytest
from django.test import override_settings

from jobs import actions
from jobs.models import Job, JobLogLine
from tests.conftest import api_client

pytestmark = pytest.mark.django_db


def ship(node, job: Job, lines: dict[tuple[int, str], list[str]], ship_id: int = 1) -> None:
    """Store lines the way an agent's logs frame does."""
    chunks = [{"rank": rank, "stream": stream, "offset": 0, "lines": texts,
               "sizes": [len(t.encode()) + 1 for t in texts], "at": time.time()}
              for (rank, stream), texts in lines.items()]
    actions.record_log_lines(node, {"type": "logs", "job": job.name, "run_id": job.run_id, "ship": ship_id,
                                    "chunks": chunks})


@pytest.fixture
def logged(researcher, other_researcher, make_job, make_nodes):
    """A researcher's job with lines from ranks 0-2 (stdout and stderr of rank 1), and another's."""
    nodes = make_nodes(racks=1, switches=1, nodes=2, gpus=4)
    placed = []
    for owner, name, node in ((researcher, "mine", nodes[0]), (other_researcher, "theirs", nodes[1])):
        job = actions.place_job(make_job(owner=owner, name=name, dp=2), [(node, 0), (node, 1)], actor="planner",
                                reason={"rule": "place", "text": "Placed.", "inputs": {}})
        Job.objects.filter(pk=job.pk).update(run_id=f"{name}-run")
        job.refresh_from_db()
        placed.append(job)
    mine, theirs = placed
    ship(nodes[0], mine, {(0, "out"): ["r0 a", "r0 b"], (1, "out"): ["r1 a"], (1, "err"): ["r1 boom"],
                          (2, "out"): ["r2 a"]})
    ship(nodes[1], theirs, {(0, "out"): ["secret"]})
    return {"mine": mine, "theirs": theirs, "node": nodes[0]}


def url(job: Job, query: str = "") -> str:
    return f"/api/jobs/{job.pk}/logs/" + (f"?{query}" if query else "")


def test_lines_come_oldest_first_with_their_run_node_rank_and_stream(researcher, logged):
    body = api_client(researcher).get(url(logged["mine"])).json()
    assert [line["text"] for line in body["lines"]] == ["r0 a", "r0 b", "r1 a", "r1 boom", "r2 a"]
    first = body["lines"][0]
    assert set(first) == {"id", "run_id", "node", "rank", "stream", "at", "text"}
    assert (first["run_id"], first["node"], first["rank"], first["stream"]) == ("mine-run", logged["node"].name, 0,
                                                                                "out")
    assert body["next_after"] is None
    ids = [line["id"] for line in body["lines"]]
    assert ids == sorted(ids)


@pytest.mark.parametrize(("query", "texts"), [
    ("rank=1", ["r1 a", "r1 boom"]),
    ("rank=0&rank=2", ["r0 a", "r0 b", "r2 a"]),
    ("rank=0,2", ["r0 a", "r0 b", "r2 a"]),
    ("rank=1&stream=err", ["r1 boom"]),
    ("stream=out", ["r0 a", "r0 b", "r1 a", "r2 a"]),
    ("rank=7", []),
])
def test_rank_and_stream_filter_the_lines(researcher, logged, query, texts):
    body = api_client(researcher).get(url(logged["mine"], query)).json()
    assert [line["text"] for line in body["lines"]] == texts


def test_pages_follow_the_id_cursor_to_the_end(researcher, logged):
    client = api_client(researcher)
    seen, after = [], 0
    for _ in range(5):
        body = client.get(url(logged["mine"], f"limit=2&after={after}")).json()
        seen += [line["text"] for line in body["lines"]]
        if body["next_after"] is None:
            break
        assert len(body["lines"]) == 2 and body["next_after"] == body["lines"][-1]["id"]
        after = body["next_after"]
    assert seen == ["r0 a", "r0 b", "r1 a", "r1 boom", "r2 a"]
    # A follower polls with its last line's id: new lines, and only those.
    ship(logged["node"], logged["mine"], {(0, "out"): ["r0 a", "r0 b", "r0 c"]}, ship_id=2)
    last = JobLogLine.objects.filter(job=logged["mine"], text="r2 a").get().id
    assert [line["text"] for line in client.get(url(logged["mine"], f"after={last}")).json()["lines"]] == ["r0 c"]


@pytest.mark.parametrize(("query", "param"), [
    ("rank=one", "rank"), ("rank=-1", "rank"), ("rank=1,x", "rank"), ("stream=both", "stream"),
    ("after=last", "after"), ("after=-5", "after"), ("limit=0", "limit"), ("limit=5001", "limit"),
    ("limit=lots", "limit"), ("ranks=1", "ranks"),
])
def test_a_bad_parameter_is_a_400_naming_it(researcher, logged, query, param):
    response = api_client(researcher).get(url(logged["mine"], query))
    assert response.status_code == 400
    assert param in response.json()


def test_the_limit_defaults_to_500_and_may_reach_5000(researcher, logged):
    client = api_client(researcher)
    ship(logged["node"], logged["mine"], {(3, "out"): [f"line {i}" for i in range(600)]}, ship_id=2)
    assert len(client.get(url(logged["mine"])).json()["lines"]) == 500
    body = client.get(url(logged["mine"], "limit=5000")).json()
    assert len(body["lines"]) == 605 and body["next_after"] is None


def test_operators_and_auditors_read_any_jobs_logs(operator, auditor, logged):
    for user in (operator, auditor):
        response = api_client(user).get(url(logged["theirs"]))
        assert response.status_code == 200 and [line["text"] for line in response.json()["lines"]] == ["secret"]


@pytest.mark.parametrize(("setting", "status"), [("summary", 403), ("all", 200), ("own", 404)])
def test_anothers_logs_answer_as_their_job_page_does(researcher, logged, setting, status):
    with override_settings(OMNI_JOB_VISIBILITY=setting):
        response = api_client(researcher).get(url(logged["theirs"]))
        assert response.status_code == status
        assert ("secret" in response.content.decode()) is (status == 200)
        page = api_client(researcher)
        page.force_login(researcher)
        assert page.get(f"/jobs/{logged['theirs'].pk}/").status_code == status


def test_users_without_a_role_and_anonymous_visitors_are_refused(outsider, logged):
    assert api_client(outsider).get(url(logged["mine"])).status_code == 403
    assert api_client().get(url(logged["mine"])).status_code in (401, 403)
    assert api_client(outsider).get("/api/jobs/999999/logs/").status_code == 403


def test_a_job_that_does_not_exist_is_a_404(researcher):
    assert api_client(researcher).get("/api/jobs/999999/logs/").status_code == 404


def test_the_query_count_does_not_grow_with_the_lines(researcher, logged, django_assert_num_queries):
    ship(logged["node"], logged["mine"], {(r, "out"): [f"more {i}" for i in range(100)] for r in range(4, 8)},
         ship_id=2)
    client = api_client(researcher)
    with django_assert_num_queries(3):  # the user's roles, the job, the lines
        assert len(client.get(url(logged["mine"], "limit=1000")).json()["lines"]) == 405
    with django_assert_num_queries(2):  # the roles are known by now
        client.get(url(logged["mine"], "rank=1&stream=err"))
