"""llm-d's default scheduling profile, as its scorers and picker define it.

Sources (Gateway API inference extension, which llm-d's inference scheduler builds on):
``pkg/epp/scheduling/framework/plugins/queuescorer/queue.go``,
``kvcacheutilizationscorer/kvcache_utilization.go``, ``prefixcachescorer/plugin.go`` and
``maxscorepicker/max_score_picker.go``; the weights are llm-d's default profile.

- prefix-cache scorer (weight 3): matched leading blocks / the request's blocks, from the
  approximate index (16-token blocks, at most 256 matched, per-instance LRU);
- queue scorer (weight 2): ``(max waiting - waiting) / (max - min)`` over the candidates,
  1 for all when they are equal;
- kv-cache-utilisation scorer (weight 2): ``1 - KV usage``;
- max-score picker: the highest weighted sum, ties broken at random.

The decision record keeps each scorer's value; its ``scores`` are the negated weighted sums
(lower is better, as for every router).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import numpy as np
from pydantic import Field

from control.routing.prefix_index import ApproximatePrefixIndex
from control.routing.snapshot import Decision, FleetSnapshot, RouteRequest


@dataclass(frozen=True)
class LlmdWeights:
    prefix: Annotated[float, Field(ge=0)] = 3.0
    queue: Annotated[float, Field(ge=0)] = 2.0
    kv_cache: Annotated[float, Field(ge=0)] = 2.0
    max_prefix_blocks: Annotated[int, Field(ge=1)] = 256


class LlmdDefault:
    name = "llmd_default"

    def __init__(self, rng: np.random.Generator, weights: LlmdWeights = LlmdWeights()) -> None:
        self._rng = rng
        self.weights = weights
        self.index = ApproximatePrefixIndex()

    def route(self, request: RouteRequest, fleet: FleetSnapshot, now: float) -> Decision:
        if not fleet.ready.any():
            return Decision(self.name, None, np.full(len(fleet), np.nan))
        total, parts = self.score(request, fleet)
        best = np.flatnonzero(total == np.nanmax(total))
        chosen = int(best[self._rng.integers(best.size)])
        self.remember(request, chosen, fleet)
        return Decision(self.name, chosen, -total, parts)

    def score(
        self, request: RouteRequest, fleet: FleetSnapshot
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Each ready instance's weighted sum (NaN where not ready) and each scorer's
        value; nothing is indexed."""
        eligible = fleet.ready
        hashes = request.prefix_blocks[: self.weights.max_prefix_blocks]
        prefix = (
            self.index.match(hashes, len(fleet)) / len(hashes) if hashes else np.zeros(len(fleet))
        )
        queue = queue_score(fleet.waiting, eligible)
        kv_free = 1.0 - fleet.kv_blocks_used / np.maximum(fleet.kv_blocks_total, 1)
        w = self.weights
        total = np.where(
            eligible, w.prefix * prefix + w.queue * queue + w.kv_cache * kv_free, np.nan
        )
        return total, {"prefix": prefix, "queue": queue, "kv_free": kv_free}

    def remember(self, request: RouteRequest, chosen: int, fleet: FleetSnapshot) -> None:
        """Index the request's prefix on the instance it was sent to."""
        hashes = request.prefix_blocks[: self.weights.max_prefix_blocks]
        self.index.add(chosen, hashes, fleet.prefix_capacity(chosen))


def queue_score(waiting: np.ndarray, eligible: np.ndarray) -> np.ndarray:
    """The queue scorer: shorter waiting queues score higher, scaled to [0, 1]."""
    low, high = waiting[eligible].min(), waiting[eligible].max()
    if high == low:
        return np.ones(len(waiting))
    scores: np.ndarray = (high - waiting) / (high - low)
    return scores
