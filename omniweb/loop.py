"""The embedded mode's in-process scheduler: runs omniweb.scheduled's periodic tasks in a
daemon thread, calling the same Celery task functions that beat would send to a worker. It sits
beside the schedule it runs: it is the project's stand-in for beat, not part of an app."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from django.db import close_old_connections

from omniweb.celery import app
from omniweb.scheduled import PERIODIC_TASKS, PeriodicTask

logger = logging.getLogger(__name__)


class InProcessLoop:
    """Calls each periodic task every ``interval_s`` until stopped. One thread, so two ticks of
    the planner can never overlap here (production relies on the advisory lock instead)."""

    def __init__(self, tasks: list[PeriodicTask] | None = None, tick_s: float = 0.2,
                 live_loop: asyncio.AbstractEventLoop | None = None):
        self.tasks = list(PERIODIC_TASKS if tasks is None else tasks)
        self.tick_s = tick_s
        #: The loop the tasks' live updates go through (``jobs.live.send_through``): the ASGI
        #: server's, when it runs in this process.
        self.live_loop = live_loop
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.runs: dict[str, int] = {task.name: 0 for task in self.tasks}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="omni-inprocess-loop", daemon=True)
        self._thread.start()
        names = ", ".join(f"{t.name} every {t.interval_s:g}s" for t in self.tasks) or "no periodic tasks"
        logger.info("in-process loop started: %s", names)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        from jobs import live

        live.send_through(self.live_loop)
        due = {task.name: 0.0 for task in self.tasks}
        while not self._stop.is_set():
            now = time.monotonic()
            for task in self.tasks:
                if now < due[task.name]:
                    continue
                due[task.name] = now + task.interval_s
                self.run_once(task)
            self._stop.wait(self.tick_s)

    def run_once(self, task: PeriodicTask) -> None:
        close_old_connections()
        try:
            app.tasks[task.name]()
            self.runs[task.name] += 1
        except Exception:  # keep the loop alive; the failure is logged with its traceback
            logger.exception("periodic task %s failed", task.name)
        finally:
            close_old_connections()
