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
    """How long after its window has passed an event still counts; later ones are late."""

    def __post_init__(self) -> None:
        ratio = self.size_s / self.slide_s
        if self.slide_s <= 0 or ratio < 1 or abs(ratio - round(ratio)) > 1e-9:
            raise ValueError("the window size must be a whole multiple of the slide")

    def slice_of(self, ts: float) -> float:
        return math.floor(ts / self.slide_s) * self.slide_s

    def window_ending(self, now: float) -> tuple[float, float]:
        """The latest whole window at ``now``: it ends at the last slide boundary."""
        end = self.slice_of(now)
        return end - self.size_s, end

    def slices(self, start: float, end: float) -> list[float]:
        count = round((end - start) / self.slide_s)
        return [start + n * self.slide_s for n in range(count)]

    def is_late(self, ts: float, watermark: float) -> bool:
        """Whether an event at ``ts`` comes after every window holding it has closed."""
        return ts < watermark - self.size_s - self.grace_s

    def expired(self, slice_start: float, watermark: float) -> bool:
        """Whether a slice can no longer be part of a published window or take events."""
        return slice_start + self.slide_s < watermark - self.size_s - self.grace_s
