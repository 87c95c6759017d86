"""Facts worked out from snapshot objects once, kept between passes by the objects' identity.

A snapshot never changes, and one built from another shares the objects that did not change (the
simulator hands the planner the same ``Job`` while a job stands, the same holdings tuple while its
GPUs do), so what a pass reads of such an object alone need not be worked out on every pass.
"""

from __future__ import annotations

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
