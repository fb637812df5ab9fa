"""Cache-aware baselines of NVIDIA Dynamo, SGLang and AIBrix, with their published defaults.

Each learns which instance holds which prefix from its own decisions (the approximate
index, in 16-token blocks), as SGLang's and AIBrix's routers do; Dynamo does so only until
the engines' KV events reach it, then follows them. "Load" is what each router counts
itself: requests or tokens in flight.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from operator import itemgetter

import numpy as np

from control.routing.prefix_index import ApproximatePrefixIndex
from control.routing.snapshot import Decision, FleetSnapshot, KvEvent, RouteRequest

BLOCK_TOKENS = 16


def _pick_lowest(scores: np.ndarray, rng: np.random.Generator) -> int:
    best = np.flatnonzero(scores == np.nanmin(scores))
    return int(best[rng.integers(best.size)])


class _Learning(ABC):
    """Shared plumbing: the index, the refusal when nothing is ready, the bookkeeping."""

    name = ""

    def __init__(self, rng: np.random.Generator) -> None:
        self._rng = rng
        self.index = ApproximatePrefixIndex()
        self._learns_from_decisions = True

    def route(self, request: RouteRequest, fleet: FleetSnapshot, now: float) -> Decision:
        if not fleet.ready.any():
            return Decision(self.name, None, np.full(len(fleet), np.nan))
        matched = self.index.match(request.prefix_blocks, len(fleet))
        decision = self._decide(request, fleet, matched)
        assert decision.chosen is not None
        if self._learns_from_decisions:
            self.index.add(
                decision.chosen, request.prefix_blocks, int(fleet.kv_blocks_total[decision.chosen])
            )
        return decision

    @abstractmethod
    def _decide(
        self, request: RouteRequest, fleet: FleetSnapshot, matched: np.ndarray
    ) -> Decision: ...


class DynamoKv(_Learning):
    """NVIDIA Dynamo's KV router, classic cost (``lib/llm/src/kv_router/scheduler.rs``,
    ``DefaultWorkerSelector``): ``overlap_weight * prefill_blocks + decode_blocks``, the
    lowest wins; weight 1.0 and temperature 0 (no sampling) by default. Prefill blocks are
    the request's blocks not already cached there; decode blocks the worker's active ones.
    """

    name = "dynamo_kv"
    overlap_weight = 1.0

    def kv_events(self, instance: int, events: Sequence[KvEvent]) -> None:
        """With KV events (Dynamo's default; ``--no-kv-events`` is its approximate mode),
        the index holds what the workers report, and no longer what the router sent."""
        self._learns_from_decisions = False
        for stored, run in itertools.groupby(events, key=itemgetter(1)):
            blocks = [block for block, _ in run]
            if stored:
                self.index.add(instance, blocks)
            else:
                self.index.evicted(instance, blocks)

    def _decide(self, request: RouteRequest, fleet: FleetSnapshot, matched: np.ndarray) -> Decision:
        prefill = (request.input_tokens - matched * BLOCK_TOKENS) / BLOCK_TOKENS
        decode = fleet.inflight_tokens / BLOCK_TOKENS
        cost = np.where(fleet.ready, self.overlap_weight * prefill + decode, np.nan)
        return Decision(
            self.name,
            _pick_lowest(cost, self._rng),
            cost,
            {"prefill_blocks": prefill, "decode_blocks": decode},
        )


class SglangCacheAware(_Learning):
    """SGLang router's cache-aware policy (``sgl-router/src/policies/cache_aware.rs``):
    when loads are imbalanced (max - min > 64 and max > 1.5 x min) the lowest load wins;
    else the longest prefix match if it covers more than 30 % of the prompt; else the lowest
    load. Load: requests in flight from this router."""

    name = "sglang_cache_aware"
    balance_abs_threshold = 64
    balance_rel_threshold = 1.5
    cache_threshold = 0.3

    def _decide(self, request: RouteRequest, fleet: FleetSnapshot, matched: np.ndarray) -> Decision:
        load = np.where(fleet.ready, fleet.requests.astype(np.float64), np.nan)
        low, high = np.nanmin(load), np.nanmax(load)
        imbalanced = (
            high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold
        )
        blocks = max(len(request.prefix_blocks), 1)
        rate = np.where(fleet.ready, matched / blocks, np.nan)
        parts = {"load": load, "match_rate": rate}
        if not imbalanced and np.nanmax(rate) > self.cache_threshold:
            return Decision(self.name, _pick_lowest(-rate, self._rng), -rate, parts)
        return Decision(self.name, _pick_lowest(load, self._rng), load, parts)


class AibrixPrefixCache(_Learning):
    """AIBrix gateway's prefix-cache routing (``pkg/plugins/gateway/algorithms/
    prefix_cache.go``): when running requests spread by more than 16, least-request; else
    the best prefix match among instances running at most mean + 2 standard deviations,
    and least-request when nothing matches."""

    name = "aibrix_prefix_cache"
    imbalance_spread = 16
    std_factor = 2.0

    def _decide(self, request: RouteRequest, fleet: FleetSnapshot, matched: np.ndarray) -> Decision:
        running = np.where(fleet.ready, fleet.requests.astype(np.float64), np.nan)
        parts = {"running": running, "matched_blocks": matched.astype(np.float64)}
        spread = np.nanmax(running) - np.nanmin(running)
        calm = running <= np.nanmean(running) + self.std_factor * np.nanstd(running)
        candidates = np.where(calm & fleet.ready, matched.astype(np.float64), np.nan)
        if spread > self.imbalance_spread or np.nanmax(candidates) <= 0:
            return Decision(self.name, _pick_lowest(running, self._rng), running, parts)
        return Decision(self.name, _pick_lowest(-candidates, self._rng), -candidates, parts)
