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


def changed_by_name(seen: Mapping[str, Any], jobs: Mapping[str, Any]) -> tuple[list[Any], list[str]]:
    """What changed from one pass's jobs by name (``seen``) to the next's (``jobs``): the jobs of
    ``jobs`` whose object is not the one ``seen`` had under its name (new, or a new snapshot of
    it), and the names ``seen`` had that ``jobs`` lacks. Found by identity, without a Python step
    per job that stands: an index kept between passes regroups only these."""
    fresh = list(compress(jobs.values(), map(is_not, jobs.values(), map(seen.get, jobs))))
    arrived = sum(1 for job in fresh if job.name not in seen)
    gone = list(seen.keys() - jobs.keys()) if len(seen) != len(jobs) - arrived else []
    return fresh, gone
