"""llm-d's predicted-latency routing, in the latency predictor's Bayesian-ridge mode.

Source: the Gateway API inference extension's latency predictor client
(``latencypredictor``: ``predictBayesianRidge``, a linear model of TTFT) and its
predicted-latency scorer (``pkg/epp/scheduling/framework/plugins/predictedlatencyscorer/``):
each candidate's TTFT is predicted from its KV-cache usage, the request's input length, the
candidate's waiting and running requests, the request's prefix-cache score there, and its
tokens in flight; the lowest prediction wins.

Training is online: the features seen at each decision are paired with the TTFT observed
for that request; the model is refitted by ridge regression on the latest ``window``
samples every ``refit_every`` observations. Until the first fit it routes by llm-d's
default scorers, whose prefix index it shares (and fills with the instances it routes to).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Annotated

import numpy as np
from pydantic import Field

from control.routing.estimators import AwaitingOutcome
from control.routing.llmd import LlmdDefault
from control.routing.snapshot import (
    PREDICTED_TTFT_S,
    Decision,
    FleetSnapshot,
    Observation,
    RouteRequest,
)

FEATURES = ("kv_usage", "input_tokens", "waiting", "running", "prefix_score", "inflight_tokens")


@dataclass(frozen=True)
class PredictedLatencyParams:
    window: Annotated[int, Field(ge=1)] = 2000
    """Latest observations the model is fitted on."""
    refit_every: Annotated[int, Field(ge=1)] = 100
    """Observations between fits."""
    ridge: Annotated[float, Field(ge=0)] = 1e-3
    """Ridge penalty on the standardised weights (the intercept is not shrunk)."""


class LlmdPredictedLatency:
    name = "llmd_predicted_latency"

    def __init__(
        self, rng: np.random.Generator, params: PredictedLatencyParams | None = None
    ) -> None:
        self.params = params or PredictedLatencyParams()
        self._rng = rng
        self._scorers = LlmdDefault(rng)
        self._window: deque[tuple[np.ndarray, float]] = deque(maxlen=self.params.window)
        self._pending: AwaitingOutcome[np.ndarray] = AwaitingOutcome()
        self._since_fit = 0
        self._model: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def route(self, request: RouteRequest, fleet: FleetSnapshot, now: float) -> Decision:
        if not fleet.ready.any():
            return Decision(self.name, None, np.full(len(fleet), np.nan))
        total, parts = self._scorers.score(request, fleet)
        features = self._features(request, fleet, parts["prefix"])
        if self._model is None:
            best = np.flatnonzero(total == np.nanmax(total))
            scores = -total
        else:
            predicted = np.where(fleet.ready, self._predict(features), np.nan)
            best = np.flatnonzero(predicted == np.nanmin(predicted))
            scores, parts = predicted, {PREDICTED_TTFT_S: predicted}
        chosen = int(best[self._rng.integers(best.size)])
        self._scorers.remember(request, chosen, fleet)  # the instance it goes to
        self._pending.put(request.request_id, features[chosen])
        return Decision(self.name, chosen, scores, parts)

    def observe(self, observation: Observation) -> None:
        features = self._pending.pop(observation.request_id)
        if features is None:
            return
        self._window.append((features, observation.ttft_s))
        self._since_fit += 1
        if self._since_fit >= self.params.refit_every:
            self._fit()

    def _features(
        self, request: RouteRequest, fleet: FleetSnapshot, prefix_score: np.ndarray
    ) -> np.ndarray:
        kv_usage = fleet.kv_blocks_used / np.maximum(fleet.kv_blocks_total, 1)
        columns = (
            kv_usage,
            np.full(len(fleet), request.input_tokens),
            fleet.waiting,
            fleet.running,
            prefix_score,
            fleet.inflight_tokens,
        )
        return np.column_stack([np.asarray(c, dtype=np.float64) for c in columns])

    def _fit(self) -> None:
        x = np.array([f for f, _ in self._window])
        y = np.array([t for _, t in self._window])
        mean, scale = x.mean(axis=0), x.std(axis=0) + 1e-9
        z = np.column_stack([np.ones(len(x)), (x - mean) / scale])
        penalty = self.params.ridge * np.eye(z.shape[1])
        penalty[0, 0] = 0.0  # the intercept is not shrunk
        weights = np.linalg.solve(z.T @ z + penalty, z.T @ y)
        self._model = (weights, mean, scale)
        self._since_fit = 0

    def _predict(self, features: np.ndarray) -> np.ndarray:
        assert self._model is not None
        weights, mean, scale = self._model
        predicted: np.ndarray = weights[0] + ((features - mean) / scale) @ weights[1:]
        return predicted
