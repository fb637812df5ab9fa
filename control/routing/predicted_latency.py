"""llm-d's predicted-latency scheduling profile, as llm-d-router's chart ships it.

Source: llm-d/llm-d-router v0.10.0 (71f4f099), ``config/charts/routerlib/templates/
_config.yaml`` (the profile with the latency predictor enabled) and the plugins under
``pkg/epp/framework/plugins/``: ``scheduling/filter/prefixcacheaffinity``,
``scheduling/filter/sloheadroomtier``, ``scheduling/scorer/latency``,
``scheduling/picker/weightedrandom``, ``requestcontrol/dataproducer/predictedlatency`` and
``requestcontrol/dataproducer/inflightload``. The model is ``latency_predictor``'s.

The profile, in order:

1. strict prefix-affinity filter: keep the endpoints whose prefix score is at least 0.99,
   unless none is, or the best of them is predicted more than 5 s slower to first token
   than the best of the rest;
2. SLO headroom tier filter: keep the endpoints predicted within the request's TTFT
   objective, save for a 1 % exploration of the others. A request without the objective's
   header has an objective of 0 ms, so every prediction violates it and every endpoint stays;
3. loose prefix-affinity filter: as 1, at 0.80;
4. latency scorer: endpoints within the objective if any; else those with none of this
   router's requests in flight ("idle"); else all. Each scores ``int((1 - n) x 100) + 1``
   where ``n`` is its predicted TTFT headroom's magnitude normalised over the group
   (0.5 when all are equal): the least predicted TTFT scores highest;
5. weighted random picker: one endpoint with probability proportional to its score
   (A-Res keys ``u^(1/score)``; uniform when all scores are 0).

Before the first model is synced there are no predictions: the affinity filters keep the
sticky endpoints, the tier filter keeps all, and the scorer's composite fallback scores
``round(100 x (kv free + relative queue + prefix) / 3) / 100``, where the relative queue
is ``(max waiting - waiting) / max waiting``.

Features per endpoint (as the predicted-latency producer sends them): KV usage and waiting
requests from the 50 ms scrape, this router's requests in flight (``num_request_running``
comes from the in-flight load producer, which counts a request until its response ends),
the uncached prompt tokens it sent that have no first token yet, the request's length and
its prefix score there. A sample pairs the chosen endpoint's features at dispatch with the
TTFT, in whole milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import numpy as np
from pydantic import Field

from control.routing.estimators import AwaitingOutcome
from control.routing.inflight import ActiveSequences, InFlight
from control.routing.latency_predictor import RAW_FEATURES, LatencyPredictor, PredictorParams
from control.routing.llmd import LlmdDefault
from control.routing.snapshot import (
    PREDICTED_TTFT_S,
    BoolArray,
    Decision,
    FleetSnapshot,
    FloatArray,
    Observation,
    RouteRequest,
)


@dataclass(frozen=True)
class PredictedLatencyParams(PredictorParams):
    """The profile's filters and scorer, and (inherited) its latency predictor's settings."""

    strict_affinity: Annotated[float, Field(ge=0, le=1)] = 0.99
    """``affinityThreshold`` of the chart's strict prefix-affinity filter."""
    loose_affinity: Annotated[float, Field(ge=0, le=1)] = 0.80
    """``affinityThreshold`` of its loose prefix-affinity filter."""
    max_ttft_penalty_ms: Annotated[float, Field(ge=0)] = 5000.0
    """``maxTTFTPenaltyMs`` of both affinity filters in the chart."""
    explore_violating: Annotated[float, Field(ge=0, le=1)] = 0.01
    """``epsilonExploreNeg`` of the SLO headroom tier filter, its default."""
    ttft_objective_ms: Annotated[float, Field(ge=0)] = 0.0
    """The TTFT objective of a request with no ``x-slo-ttft-ms`` header (0, as upstream)."""


class LlmdPredictedLatency:
    name = "llmd_predicted_latency"

    def __init__(
        self, rng: np.random.Generator, params: PredictedLatencyParams | None = None
    ) -> None:
        self.params = params or PredictedLatencyParams()
        self._rng = rng
        self._prefix = LlmdDefault(rng)  # its approximate index is the profile's prefix source
        self.predictor = LatencyPredictor(rng, self.params)
        self._requests = InFlight()
        self._prefill = ActiveSequences()
        self._pending: AwaitingOutcome[FloatArray] = AwaitingOutcome()

    def route(self, request: RouteRequest, fleet: FleetSnapshot, now: float) -> Decision:
        if not fleet.ready.any():
            return Decision(self.name, None, np.full(len(fleet), np.nan))
        self.predictor.tick(now)
        _, parts = self._prefix.score(request, fleet)
        prefix = parts["prefix"]
        features = self._features(request, fleet, prefix)
        ttft_ms = self.predictor.predict(features)
        kept = self._filter(fleet.ready, prefix, ttft_ms)
        if ttft_ms is None:
            scores = self._composite(fleet, prefix, kept)
        else:
            scores = self._latency_scores(ttft_ms, kept)
            parts[PREDICTED_TTFT_S] = ttft_ms / 1000.0
        chosen = self._pick(scores, kept)
        self._dispatched(request, chosen, fleet, features[chosen])
        ranked = np.where(kept, -scores, np.where(fleet.ready, 1.0, np.nan))
        return Decision(self.name, chosen, ranked, parts)  # filtered out: after every kept one

    def observe(self, observation: Observation) -> None:
        features = self._pending.pop(observation.request_id)
        if features is not None:
            self.predictor.add(features, float(int(observation.ttft_s * 1000)))

    def first_token(self, request_id: str) -> None:
        self._prefill.prefill_done(request_id)

    def ended(self, request_id: str) -> None:
        self._requests.ended(request_id)
        self._prefill.free(request_id)

    def _features(
        self, request: RouteRequest, fleet: FleetSnapshot, prefix: FloatArray
    ) -> FloatArray:
        size = len(fleet)
        columns = {
            "kv_cache_percentage": fleet.kv_blocks_used / np.maximum(fleet.kv_blocks_total, 1),
            "input_token_length": np.full(size, request.input_tokens),
            "num_request_waiting": fleet.waiting,
            "num_request_running": self._requests.counts(size),
            "prefill_tokens_in_flight": self._prefill.prefill_tokens(size),
            "prefix_cache_score": prefix,
        }
        return np.column_stack([np.asarray(columns[name], np.float64) for name in RAW_FEATURES])

    def _filter(
        self, ready: BoolArray, prefix: FloatArray, ttft_ms: FloatArray | None
    ) -> BoolArray:
        """Filters 1 to 3 of the profile: the endpoints kept."""
        p = self.params
        kept = self._affinity(ready, prefix, ttft_ms, p.strict_affinity)
        if ttft_ms is not None:
            within = kept & (p.ttft_objective_ms - ttft_ms >= 0)
            violating = kept & ~within
            if within.any() and violating.any():
                kept = violating if self._rng.random() < p.explore_violating else within
        return self._affinity(kept, prefix, ttft_ms, p.loose_affinity)

    def _affinity(
        self, kept: BoolArray, prefix: FloatArray, ttft_ms: FloatArray | None, threshold: float
    ) -> BoolArray:
        if kept.sum() <= 1 or threshold <= 0:
            return kept
        sticky = kept & (prefix >= threshold)
        rest = kept & ~sticky
        if not sticky.any():
            return kept
        if ttft_ms is not None and rest.any():
            penalty = ttft_ms[sticky].min() - ttft_ms[rest].min()
            if penalty > self.params.max_ttft_penalty_ms:
                return kept  # the load gate breaks the affinity
        return sticky

    def _latency_scores(self, ttft_ms: FloatArray, kept: BoolArray) -> FloatArray:
        within = kept & (self.params.ttft_objective_ms - ttft_ms >= 0)
        idle = kept & (self._requests.counts(len(kept)) == 0)
        group = within if within.any() else idle if idle.any() else kept
        headroom = np.abs(self.params.ttft_objective_ms - ttft_ms)
        low, high = headroom[group].min(), headroom[group].max()
        spread = (headroom - low) / (high - low) if high - low > 1e-9 else np.full(len(kept), 0.5)
        weights = ((1.0 - spread) * 100).astype(np.int64) + 1
        return np.where(group, weights / 100.0, 0.0)

    def _composite(self, fleet: FleetSnapshot, prefix: FloatArray, kept: BoolArray) -> FloatArray:
        kv_free = 1.0 - fleet.kv_blocks_used / np.maximum(fleet.kv_blocks_total, 1)
        most = fleet.waiting[kept].max()
        queue = (most - fleet.waiting) / most if most > 0 else np.ones(len(fleet))
        composite = (kv_free + queue + prefix) / 3.0
        return np.where(kept, np.round(100 * composite) / 100.0, 0.0)

    def _pick(self, scores: FloatArray, kept: BoolArray) -> int:
        rows = np.flatnonzero(kept)
        weights = scores[rows]
        if not (weights > 0).any():
            return int(rows[self._rng.integers(rows.size)])
        draws = np.maximum(self._rng.random(rows.size), 1e-10)
        keys = np.where(weights > 0, draws ** (1.0 / np.maximum(weights, 1e-12)), 0.0)
        return int(rows[np.argmax(keys)])

    def _dispatched(
        self, request: RouteRequest, chosen: int, fleet: FleetSnapshot, features: FloatArray
    ) -> None:
        self._prefix.remember(request, chosen, fleet)
        self._requests.dispatched(request.request_id, chosen)
        uncached = request.input_tokens * (1.0 - features[RAW_FEATURES.index("prefix_cache_score")])
        self._prefill.add(request.request_id, chosen, uncached, 0.0)
        self._pending.put(request.request_id, features)
