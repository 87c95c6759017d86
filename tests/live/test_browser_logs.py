"""The job page's Logs panel follows lines an agent ships after the page loaded, in Chromium against
``manage.py serve`` (the fixtures of tests/live/test_browser.py): the rank filter hides the other
ranks, new ranks join the filter, and the view follows the newest line until the user scrolls up.

The lines go in through ``jobs.actions.record_log_lines``, what the agent socket calls for a
``logs`` frame, in a thread of its own; jobs.live sends them after commit (docs/logs.md).
"""

from __future__ import annotations

import time

import pytest

from jobs import actions
from jobs.models import Job, Node
from tests.live import test_browser as shared

pytestmark = shared.pytestmark

asgi_server = shared.asgi_server
shared_channel_layer = shared.shared_channel_layer
browser = shared.browser
open_as = shared.open_as
in_thread = shared.in_thread
wait_live = shared.wait_live

LIVE_S = 3000  # ms a panel may take to follow its cause


class Agent:
    """What a node's shipper sends: consecutive lines per rank file, each with its offset."""

    def __init__(self, job: Job, node: Node) -> None:
        self.job, self.node, self.ship, self.offsets = job, node, 0, {}

    def send(self, rank: int, stream: str, *lines: str) -> None:
        offset = self.offsets.get((rank, stream), 0)
        sizes = [len(line.encode()) + 1 for line in lines]
        self.offsets[(rank, stream)] = offset + sum(sizes)
        self.ship += 1
        frame = {"type": "logs", "job": self.job.name, "run_id": self.job.run_id, "ship": self.ship,
                 "chunks": [{"rank": rank, "stream": stream, "offset": offset, "lines": list(lines), "sizes": sizes,
                             "at": time.time()}]}
        in_thread(lambda: actions.record_log_lines(Node.objects.get(pk=self.node.pk), frame))


@pytest.fixture
def agent(researcher, make_job, make_nodes) -> Agent:
    def build() -> Agent:
        nodes = make_nodes(racks=1, switches=1, nodes=1, gpus=4)
        job = actions.place_job(make_job(name="chatty", dp=4, dp_min=1, dp_max=4),
                                [(nodes[0], i) for i in range(4)], actor="planner",
                                reason={"rule": "place", "text": "Placed.", "inputs": {}})
        Job.objects.filter(pk=job.pk).update(run_id="chatty-1")
        job.refresh_from_db()
        return Agent(job, nodes[0])

    return in_thread(build)


def visible_texts(page) -> list[str]:
    return page.locator("#log-lines .log-line:visible .text").all_inner_texts()


def test_a_line_shipped_after_load_appears_and_the_rank_filter_hides_other_ranks(open_as, asgi_server, researcher,
                                                                                 agent):
    agent.send(0, "out", "rank 0 starting")
    agent.send(1, "out", "rank 1 starting")
    page = open_as(researcher)
    page.goto(f"{asgi_server}/jobs/{agent.job.pk}/")
    wait_live(page)
    assert visible_texts(page) == ["rank 0 starting", "rank 1 starting"]

    agent.send(1, "err", "rank 1: CUDA out of memory")
    line = page.locator("#log-lines .log-line.err", has_text="rank 1: CUDA out of memory")
    line.wait_for(timeout=LIVE_S)
    assert line.get_attribute("data-rank") == "1"
    assert page.evaluate("getComputedStyle(document.querySelector('#log-lines .log-line.err .text')).color") != \
        page.evaluate("getComputedStyle(document.querySelector('#log-lines .log-line.out .text')).color")

    page.select_option("#log-rank", "1")
    assert visible_texts(page) == ["rank 1 starting", "rank 1: CUDA out of memory"]
    agent.send(0, "out", "rank 0 step 1")  # arrives hidden while rank 1 is chosen
    page.locator("#log-lines .log-line", has_text="rank 0 step 1").wait_for(state="attached", timeout=LIVE_S)
    assert visible_texts(page) == ["rank 1 starting", "rank 1: CUDA out of memory"]
    agent.send(7, "out", "a rank the layout did not show")  # a new rank joins the filter
    page.locator("#log-rank option[value='7']").wait_for(state="attached", timeout=LIVE_S)
    page.select_option("#log-rank", "")
    assert visible_texts(page)[-2:] == ["rank 0 step 1", "a rank the layout did not show"]


def test_the_view_follows_new_lines_until_the_user_scrolls_up(open_as, asgi_server, researcher, agent):
    agent.send(0, "out", *[f"warm-up {i}" for i in range(120)])
    page = open_as(researcher)
    page.goto(f"{asgi_server}/jobs/{agent.job.pk}/")
    wait_live(page)
    at_bottom = "(() => { const b = document.getElementById('log-lines'); " \
                "return b.scrollHeight - b.scrollTop - b.clientHeight < 8; })()"
    assert page.evaluate(at_bottom)
    agent.send(0, "out", *[f"step {i}" for i in range(40)])
    page.locator("#log-lines .log-line", has_text="step 39").wait_for(timeout=LIVE_S)
    page.wait_for_function(at_bottom, timeout=LIVE_S)

    page.locator("#log-lines").evaluate("b => { b.scrollTop = 0; b.dispatchEvent(new Event('scroll')); }")
    assert not page.locator("#log-follow").is_checked()
    agent.send(0, "out", *[f"later {i}" for i in range(40)])
    page.locator("#log-lines .log-line", has_text="later 39").wait_for(timeout=LIVE_S)
    assert page.locator("#log-lines").evaluate("b => b.scrollTop") == 0  # left where the reader is

    page.check("#log-follow")  # follow again: to the newest line
    page.wait_for_function(at_bottom, timeout=LIVE_S)


def test_a_failure_while_the_page_is_open_draws_the_failure_box(open_as, asgi_server, researcher, agent):
    page = open_as(researcher)
    page.goto(f"{asgi_server}/jobs/{agent.job.pk}/")
    wait_live(page)
    assert page.locator("#job-failure").count() == 0
    outcome = {"outcome": "failed", "run_id": "chatty-1", "leader": True, "code": 1, "rank": 2, "at": time.time(),
               "error": "Traceback (most recent call last):\nValueError: the batch does not split"}
    in_thread(lambda: actions.record_worker_exit(Node.objects.get(pk=agent.node.pk), agent.job.name, outcome))
    box = page.locator("#job-failure")
    box.wait_for(timeout=LIVE_S)
    assert box.locator("strong").inner_text() == "Failed"
    assert box.locator("[data-f=sentence]").inner_text() == f"Rank 2 on {agent.node.name} exited with code 1"
    assert "ValueError: the batch does not split" in box.locator("[data-f=tail]").inner_text()
    page.reload()  # the page drawn afresh says the same
    assert page.locator("#job-failure [data-f=sentence]").inner_text() == f"Rank 2 on {agent.node.name} exited with code 1"


def test_lines_stored_before_the_socket_subscribes_are_caught_up_from_the_api(open_as, asgi_server, researcher,
                                                                              agent):
    import json

    from django.utils import timezone

    from jobs.models import JobLogLine

    agent.send(0, "out", "on the page")
    page = open_as(researcher)
    sockets = []
    page.route_web_socket("**/ws/live/", lambda ws: sockets.append(ws))  # held: no live messages
    page.goto(f"{asgi_server}/jobs/{agent.job.pk}/")
    assert visible_texts(page) == ["on the page"]
    # Stored after the page was drawn, and never sent live (as if before the subscription).
    in_thread(lambda: JobLogLine.objects.bulk_create(
        JobLogLine(job=agent.job, run_id=agent.job.run_id, node=agent.node.name, rank=1, stream="out",
                   offset=1000 + i, at=timezone.now(), text=f"missed {i}") for i in range(3)))
    page.wait_for_function("() => true")
    assert sockets, "the page opened no live socket"
    sockets[0].send(json.dumps({"type": "subscribed", "stream": "job", "id": agent.job.pk}))
    page.locator("#log-lines .log-line", has_text="missed 2").wait_for(timeout=LIVE_S)
    assert visible_texts(page) == ["on the page", "missed 0", "missed 1", "missed 2"]
