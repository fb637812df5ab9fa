"""Cache-aware baselines of NVIDIA Dynamo, SGLang and AIBrix, with the defaults their code
ships (each docstring names the file and commit it follows).

Each learns which instance holds which prefix from its own decisions (the approximate
index, in 16-token blocks), as SGLang's and AIBrix's routers do; Dynamo does so only until
the engines' KV events reach it, then follows them. "Load" is what each router counts
itself of the requests it sent (``control.routing.inflight``), as upstream: requests in
flight, or Dynamo's active prefill tokens and blocks.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Annotated

import numpy as np
from pydantic import Field

from control.routing.baselines import CountsOwnRequests
from control.routing.inflight import ActiveSequences
from control.routing.prefix_index import ApproximatePrefixIndex
from control.routing.snapshot import Decision, FleetSnapshot, KvEvent, RouteRequest
from control.tokens import BLOCK_TOKENS


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
                decision.chosen, request.prefix_blocks, fleet.prefix_capacity(decision.chosen)
            )
        return decision

    @abstractmethod
    def _decide(
        self, request: RouteRequest, fleet: FleetSnapshot, matched: np.ndarray
    ) -> Decision: ...


@dataclass(frozen=True)
class DynamoParams:
    overlap_weight: Annotated[float, Field(ge=0)] = 1.0
    """``overlap_score_weight``, ``KvRouterConfig::default``."""


class DynamoKv(_Learning):
    """NVIDIA Dynamo's KV router as its code ships (``lib/llm/src/kv_router/scheduler.rs``
    at ai-dynamo/dynamo db19bd2a, ``DefaultWorkerSelector``; ``KvRouterConfig::default``):
    cost = ``overlap_score_weight`` x potential prefill blocks + decode blocks, lowest wins,
    weight 1.0 and temperature 0 (no sampling); ties go to the worker with the smallest
    indexed tree, then at random.

    - potential prefill blocks: (the worker's active prefill tokens + this request's
      tokens not cached there) / block size;
    - decode blocks: the worker's active blocks; no predicted output blocks
      (``router_track_output_blocks`` is off by default).

    Active prefill tokens and blocks are the router's own record of what it sent
    (``ActiveSequencesMultiWorker``): a request's uncached tokens count until its first
    token, its new blocks until it ends (``inflight.ActiveSequences``; replicas share none
    by default, ``router_replica_sync`` off). The newest selector
    (``lib/kv-router/src/scheduling/selector/default.rs`` at a4bdb9bf) adds an overlap
    credit and an active-request term, not modelled here.
    """

    name = "dynamo_kv"

    def __init__(self, rng: np.random.Generator, params: DynamoParams | None = None) -> None:
        super().__init__(rng)
        self.params = params or DynamoParams()
        self.active = ActiveSequences()

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

    def first_token(self, request_id: str) -> None:
        self.active.prefill_done(request_id)

    def ended(self, request_id: str) -> None:
        self.active.free(request_id)

    def _decide(self, request: RouteRequest, fleet: FleetSnapshot, matched: np.ndarray) -> Decision:
        size = len(fleet)
        uncached = np.maximum(request.input_tokens - matched * BLOCK_TOKENS, 0).astype(float)
        prefill = (self.active.prefill_tokens(size) + uncached) / BLOCK_TOKENS
        decode = self.active.blocks(size)
        cost = np.where(fleet.ready, self.params.overlap_weight * prefill + decode, np.nan)
        lowest = np.flatnonzero(cost == np.nanmin(cost))
        trees = self.index.sizes(size)[lowest]
        smallest = lowest[trees == trees.min()]
        chosen = int(smallest[self._rng.integers(smallest.size)])
        new_blocks = -(-float(uncached[chosen]) // BLOCK_TOKENS)
        self.active.add(request.request_id, chosen, float(uncached[chosen]), new_blocks)
        parts = {"prefill_blocks": prefill, "decode_blocks": decode}
        return Decision(self.name, chosen, cost, parts)


@dataclass(frozen=True)
class SglangParams:
    """The launch command's defaults (``src/main.rs`` at 01f6c92a); the library's
    ``CacheAwareConfig::default()`` differs (0.5, 32, 1.1), but deployments start the
    router from the command."""

    balance_abs_threshold: Annotated[int, Field(ge=0)] = 64
    balance_rel_threshold: Annotated[float, Field(ge=1)] = 1.5
    cache_threshold: Annotated[float, Field(ge=0, le=1)] = 0.3


class SglangCacheAware(CountsOwnRequests, _Learning):
    """SGLang's router, cache-aware policy (``sgl-model-gateway/src/policies/
    cache_aware.rs`` at sgl-project/sglang b93974f1), with its launch command's defaults
    (``src/main.rs`` at 01f6c92a): when loads are imbalanced (max - min > 64 and max >
    1.5 x min) the least loaded worker; else the longest prefix match if it covers more
    than 30 % of the prompt; else the least loaded. Load is the router's own requests in
    flight to each worker (``WorkerLoadGuard``, counted at dispatch and released when the
    response ends: ``routers/http/router.rs`` at 033e8423). Ties of load go to the first
    worker (Rust's ``min_by_key``), ties of match at random (the tree's map order).

    Departures: the match is counted in 16-token blocks (64 characters by
    ``control/tokens.py``), not characters, so a prompt's last partial block never
    matches; the cut is a fraction of a block either way. The index holds at most an
    instance's KV capacity, least recently used first, where SGLang's tree keeps up to
    67 M characters and evicts every 120 s: ours forgets sooner what the engine likely
    evicted, which favours it.
    """

    name = "sglang_cache_aware"

    def __init__(self, rng: np.random.Generator, params: SglangParams | None = None) -> None:
        CountsOwnRequests.__init__(self)
        _Learning.__init__(self, rng)
        self.params = params or SglangParams()

    def _decide(self, request: RouteRequest, fleet: FleetSnapshot, matched: np.ndarray) -> Decision:
        load = self.own_load(fleet)
        low, high = np.nanmin(load), np.nanmax(load)
        given = self.params
        imbalanced = (
            high - low > given.balance_abs_threshold and high > low * given.balance_rel_threshold
        )
        blocks = max(len(request.prefix_blocks), 1)
        rate = np.where(fleet.ready, matched / blocks, np.nan)
        parts = {"load": load, "match_rate": rate}
        if not imbalanced and np.nanmax(rate) > given.cache_threshold:
            decision = Decision(self.name, _pick_lowest(-rate, self._rng), -rate, parts)
        else:
            first_least = int(np.flatnonzero(load == low)[0])
            decision = Decision(self.name, first_least, load, parts)
        assert decision.chosen is not None
        self.inflight.dispatched(request.request_id, decision.chosen)
        return decision


@dataclass(frozen=True)
class AibrixParams:
    imbalance_abs_count: Annotated[int, Field(ge=0)] = 8
    """``AIBRIX_PREFIX_CACHE_POD_RUNNING_REQUEST_IMBALANCE_ABS_COUNT``'s code default."""
    std_factor: Annotated[float, Field(ge=0)] = 1.0
    """``AIBRIX_PREFIX_CACHE_STANDARD_DEVIATION_FACTOR``'s code default."""


class AibrixPrefixCache(CountsOwnRequests, _Learning):
    """AIBrix gateway's prefix-cache routing with its code defaults
    (``pkg/plugins/gateway/algorithms/prefix_cache.go`` at vllm-project/aibrix e3e10f9e,
    v0.7.0+156; the README's 16 and 2 standard deviations are older). Load is the gateway's
    own count of each pod's running requests (``realtime_num_requests_running``: one more
    after routing, one fewer when the request is done).

    - When the counts spread by more than 8 (``AIBRIX_PREFIX_CACHE_POD_RUNNING_REQUEST_
      IMBALANCE_ABS_COUNT``), only the pods with the fewest are candidates.
    - Among candidates holding a prefix match whose count is at most mean + 1 standard
      deviation of all ready pods' (``AIBRIX_PREFIX_CACHE_STANDARD_DEVIATION_FACTOR``):
      the best match, then the fewest running requests, then at random.
    - None: the pod with the fewest running requests of all ready ones, at random among
      ties.

    Departures: the match is in 16-token blocks where AIBrix hashes 4-byte blocks of the
    text and compares whole percents; the index is bounded as SGLang's is above.
    """

    name = "aibrix_prefix_cache"

    def __init__(self, rng: np.random.Generator, params: AibrixParams | None = None) -> None:
        CountsOwnRequests.__init__(self)
        _Learning.__init__(self, rng)
        self.params = params or AibrixParams()

    def _decide(self, request: RouteRequest, fleet: FleetSnapshot, matched: np.ndarray) -> Decision:
        running = self.own_load(fleet)
        parts = {"running": running, "matched_blocks": matched.astype(np.float64)}
        candidates = fleet.ready.copy()
        if np.nanmax(running) - np.nanmin(running) > self.params.imbalance_abs_count:
            candidates &= running == np.nanmin(running)
        limit = np.nanmean(running) + self.params.std_factor * np.nanstd(running)
        matching = candidates & (matched > 0) & (running <= limit)
        if matching.any():
            best = matching & (matched == matched[matching].max())
            best &= running == np.nanmin(np.where(best, running, np.nan))
            chosen = int(self._rng.choice(np.flatnonzero(best)))
            scores = np.where(matching, -matched.astype(np.float64), np.nan)
        else:
            chosen = _pick_lowest(running, self._rng)
            scores = running
        self.inflight.dispatched(request.request_id, chosen)
        return Decision(self.name, chosen, scores, parts)
