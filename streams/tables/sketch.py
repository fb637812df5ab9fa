"""A mergeable quantile sketch with relative error (the DDSketch idea: log-spaced buckets).

A value ``x > 0`` lands in bucket ``ceil(log(x) / log(gamma))`` with
``gamma = (1 + a) / (1 - a)``; every value of a bucket is within ``a`` (relative) of the
bucket's representative. Two sketches merge by adding counts, so per-slice sketches
combine into any window. Values at or below ``MIN_VALUE`` share one bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

RELATIVE_ACCURACY = 0.01
_GAMMA = (1 + RELATIVE_ACCURACY) / (1 - RELATIVE_ACCURACY)
_LOG_GAMMA = math.log(_GAMMA)
MIN_VALUE = 1e-6
_ZERO = -(10**6)


@dataclass
class QuantileSketch:
    buckets: dict[int, int] = field(default_factory=dict)
    count: int = 0

    def add(self, value: float) -> None:
        index = _ZERO if value <= MIN_VALUE else math.ceil(math.log(value) / _LOG_GAMMA)
        self.buckets[index] = self.buckets.get(index, 0) + 1
        self.count += 1

    def merge(self, other: QuantileSketch) -> None:
        for index, count in other.buckets.items():
            self.buckets[index] = self.buckets.get(index, 0) + count
        self.count += other.count

    def quantile(self, q: float) -> float:
        """The q-quantile (0 <= q <= 1) within the relative accuracy; 0.0 when empty."""
        if not self.count:
            return 0.0
        rank = q * (self.count - 1)
        seen = 0
        for index in sorted(self.buckets):
            seen += self.buckets[index]
            if seen > rank:
                return 0.0 if index == _ZERO else 2 * _GAMMA**index / (_GAMMA + 1)
        raise AssertionError("unreachable: counts add up to count")

    def to_dict(self) -> dict[str, int]:
        return {str(k): v for k, v in self.buckets.items()}

    @classmethod
    def from_dict(cls, data: dict[str, int]) -> QuantileSketch:
        buckets = {int(k): v for k, v in data.items()}
        return cls(buckets, sum(buckets.values()))
