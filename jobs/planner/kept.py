"""Facts worked out from snapshot objects once, kept between passes by the objects' identity.

A snapshot never changes, and one built from another shares the objects that did not change (the
simulator hands the planner the same ``Job`` while a job stands, the same holdings tuple while its
GPUs do), so what a pass reads of such an object alone need not be worked out on every pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import compress
from operator import is_not
from typing import Any


class KeptById(dict[int, tuple]):
    """``id(obj)`` -> ``(obj, *facts)``. The object is kept in its entry, so its ``id`` is not
    reused while the entry stands. A hot loop reads ``hit = kept.get(id(obj))`` and takes it only
    when ``hit[0] is obj``, else ``kept.keep(obj, *facts)``."""

    __slots__ = ()

    def keep(self, obj: Any, *facts: Any) -> tuple:
        """Keep ``facts`` for ``obj``; returns the entry, ``(obj, *facts)``."""
        entry = self[id(obj)] = (obj, *facts)
        return entry

    def trim(self, in_sight: int) -> bool:
        """Forget every entry once they outgrow the ``in_sight`` objects a pass reads (four times
        over, and a thousand); whether it did."""
        if len(self) > 4 * in_sight + 1024:
            self.clear()
            return True
        return False


class KeptByName:
    """An index of a pass's jobs kept from one pass to the next, changed only where they did.

    ``update`` compares this pass's live jobs by name with the last pass's by identity, without
    a Python step per job that stands (the simulator hands a pass the same ``Job`` while a job
    stands), and calls ``drop`` for each name that is gone or has a new snapshot, then ``add``
    for each new snapshot. A subclass keeps what it needs of a job in those two.
    """

    def __init__(self) -> None:
        self.seen: Mapping[str, Any] = {}  # the last pass's live jobs by name

    def update(self, jobs: Mapping[str, Any]) -> None:
        """Bring the index to this pass's live jobs by name (``live_jobs_by_name``), kept as is."""
        seen = self.seen
        fresh = list(compress(jobs.values(), map(is_not, jobs.values(), map(seen.get, jobs))))
        arrived = sum(1 for job in fresh if job.name not in seen)
        if len(seen) != len(jobs) - arrived:  # some job is over
            for name in seen.keys() - jobs.keys():
                self.drop(name)
        for job in fresh:
            self.drop(job.name)
            self.add(job)
        self.seen = jobs

    def add(self, job: Any) -> None:  # pragma: no cover - each index gives its own
        raise NotImplementedError

    def drop(self, name: str) -> None:  # pragma: no cover - each index gives its own
        raise NotImplementedError
