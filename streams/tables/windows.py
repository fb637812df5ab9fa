"""Hopping windows built from slices: a window of ``size_s`` that moves by ``slide_s`` is
the merge of the ``size_s / slide_s`` slices it covers, so each event updates one slice
and mergeable aggregates make every window."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class WindowSpec:
    size_s: float = 60.0
    slide_s: float = 5.0
    grace_s: float = 10.0
    """How long past the window behind the latest event a slice (and the ids counted in it)
    is kept; lateness itself is the window's (``is_late``)."""

    def __post_init__(self) -> None:
        ratio = self.size_s / self.slide_s
        if self.slide_s <= 0 or ratio < 1 or abs(ratio - round(ratio)) > 1e-9:
            raise ValueError("the window size must be a whole multiple of the slide")

    def slice_of(self, ts: float) -> float:
        return math.floor(ts / self.slide_s) * self.slide_s

    def slices(self, now: float) -> list[float]:
        """The starts of the slices of the window up to ``now``: the slice still open at
        ``now`` (last) and the whole slices before it, ``size_s`` in all, so an event counts
        as soon as it is applied rather than when its slice closes. The window spans from
        the first start to ``now``, between ``size_s - slide_s`` and ``size_s`` seconds.
        Each start is a whole number of slides, as ``slice_of`` makes them, so they match
        its keys."""
        count = round(self.size_s / self.slide_s)
        last = math.floor(now / self.slide_s)
        return [n * self.slide_s for n in range(last - count + 1, last + 1)]

    def is_late(self, ts: float, watermark: float) -> bool:
        """Whether an event at ``ts`` comes after every window holding it has closed: its
        slice is before the first of the window up to ``watermark``, so no table published
        from then on would hold it. (Measured from the window's end and its grace, an event
        55 to 70 s old went into a slice no later window held, counted nowhere.)"""
        count = round(self.size_s / self.slide_s)
        first = (math.floor(watermark / self.slide_s) - count + 1) * self.slide_s  # slices()'
        return self.slice_of(ts) < first

    def expired(self, slice_start: float, watermark: float) -> bool:
        """Whether a slice can no longer be part of a published window or take events."""
        return slice_start + self.slide_s < watermark - self.size_s - self.grace_s
