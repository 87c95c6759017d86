"""A long queue walked by groups: jobs that a pass's state cannot tell apart wait or go together.

A planning pass walks its waiting jobs in queue order and, for each, either decides it (which may
change the pass's state: GPUs taken, a search failed) or leaves it waiting because, in the state
as it stands, it could not start. On a full cluster's long queue nearly every job is left
waiting, and most of the pass is spent keying, sorting and testing jobs that change nothing.

When the test for "left waiting" reads of a job only a few of its properties (its smallest size,
its standing, its class...), the jobs with the same ones form a *group*: while the state stands,
a group is either *shut* (all its jobs wait) or open. ``walk_by_groups`` then takes, in queue
order, the next job of the ungrouped ones or of the open groups, decides it, and looks again; a
group that stays shut is never sorted, its jobs never keyed. It decides exactly what the walk
job by job decides, at a fraction of the cost (``tests/planner/test_quiet_walk.py`` holds it to
that walk).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

G = TypeVar("G", bound=Hashable)
J = TypeVar("J")


def walk_by_groups(
    others: Sequence[tuple[tuple, J]],
    groups: dict[G, list[tuple]],
    key_of: Callable[[G, tuple], tuple],
    shut_now: Callable[[], Callable[[G], bool]],
    decide: Callable[[J], Any],
    passed: Callable[[G], Any] | None = None,
    heeds: Callable[[G], bool] = lambda g: True,
    head_aware: bool = False,
) -> None:
    """Walk ``others`` (``(queue key, job)``, sorted) and ``groups`` together in queue order.

    - ``groups[g]`` lists the group's jobs as tuples whose last item is the job; sorted, they must
      be in queue order, and ``key_of(g, member)`` gives a member's queue key (comparable with the
      keys of ``others``).
    - ``shut_now()`` returns the test of the state as it stands: ``shut(g)`` is True when every job
      of ``g`` would be left waiting. It is asked again after each ``decide``.
    - ``decide(job)`` decides a job of ``others`` or of an open group.
    - With ``head_aware``, ``shut(g, at)`` is given ``at()``, the index in the sorted group of its
      first job not yet behind the walk (asked only if needed: it sorts the group), so a group's
      terms can be those of the jobs still ahead.
    - ``passed(g)``, if given, is called when the walk passes jobs of a shut group that
      ``heeds(g)`` (before the next job it decides, or at the end). ``heeds`` is asked first so
      that a group nobody heeds is not sorted to find out.
    """
    # Per sorted group: (how many of its jobs lie behind the walk, the queue key of the next one,
    # or None when none is left). The walk only moves forward, so a next key still after the
    # job decided last needs no search.
    heads: dict[G, tuple[int, tuple | None]] = {}

    def head_of(g: G, last: tuple | None) -> tuple[int, tuple | None]:
        # The group's first job after the queue key ``last`` (sorting the group first), and its key.
        members = groups[g]
        hit = heads.get(g)
        if hit is None:
            members.sort()
            lo = 0
        else:
            lo, key = hit
            if last is None or (key is not None and key > last):
                return hit
        if last is not None:
            lo = bisect.bisect_right(members, last, lo=lo, key=lambda m: key_of(g, m))
        hit = heads[g] = (lo, key_of(g, members[lo]) if lo < len(members) else None)
        return hit

    head = 0
    last: tuple | None = None  # the queue key of the job decided last
    while True:
        shut = shut_now()
        best_key, best_job, best_group = (others[head] + (None,)) if head < len(others) else (None, None, None)
        best_at = 0
        closed = []
        for g, members in groups.items():
            if shut(g, lambda g=g, last=last: head_of(g, last)[0]) if head_aware else shut(g):
                closed.append(g)
                continue
            i, key = head_of(g, last)
            if key is not None and (best_key is None or key < best_key):
                best_key, best_job, best_group, best_at = key, members[i][-1], g, i
        if passed is not None:
            for g in closed:
                if heeds(g):
                    key = head_of(g, last)[1]
                    if key is not None and (best_key is None or key < best_key):
                        passed(g)
        if best_job is None:
            return
        if best_group is None:
            head += 1
        else:
            members = groups[best_group]
            nxt = best_at + 1
            heads[best_group] = (nxt, key_of(best_group, members[nxt]) if nxt < len(members) else None)
        last = best_key
        decide(best_job)
