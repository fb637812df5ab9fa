"""llm-d's latency predictor as its chart runs it: a training server that fits XGBoost to
the TTFTs the router reports, and prediction servers that answer with the last model they
synced.

Sources: llm-d/llm-d-latency-predictor at 04e44cd (``training/training_server.py``:
``_get_bucket_key``, ``_prepare_features_with_interaction``, ``_train_model_with_scaling``,
the gated ensemble in ``train``; ``prediction/prediction_server.py``), and the settings
llm-d-router's chart gives them (``config/charts/routerlib/values.yaml`` at 71f4f099:
retrain every 10 s once it has 100 samples, 500 samples per bucket, objective ``mean``,
prediction servers syncing the model every 30 s).

- Samples are kept in buckets by (waiting queue, KV usage in 5 % steps, prefix score in
  quarters), at most 500 each, the oldest dropped; one in ten is held out as test data,
  which no model is fitted on.
- The TTFT model is gradient-boosted trees with the server's frozen parameters. Once the
  samples with and without a waiting queue number 200 each, it is two models (the gated
  ensemble, on by default): one for an empty queue, fitted without the queue features.
- Until a model has been synced the prediction servers answer 503, and the router falls
  back (``predict`` returns None).

Departures: the model is fitted at each 30 s sync on the samples held then (upstream fits
every 10 s and the predictors load the latest fit at their sync: the same model, reached
with a third of the fits); TPOT is not modelled, because the chart's router runs
non-streaming mode, where TPOT headroom is zero for every endpoint and never ranks one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
import numpy.typing as npt
import xgboost as xgb
from pydantic import Field

FloatArray = npt.NDArray[np.float64]

RAW_FEATURES = (
    "kv_cache_percentage",
    "input_token_length",
    "num_request_waiting",
    "num_request_running",
    "prefill_tokens_in_flight",
    "prefix_cache_score",
)
"""What the router sends per endpoint, in this order (the rest of the request, decode tokens
in flight, encoder sizes and pod type, is constant in a text-only monolithic pool)."""

KV, INPUT, WAITING, RUNNING, PREFILL_IN_FLIGHT, PREFIX = range(len(RAW_FEATURES))

PREFIX_BUCKETS = 4
KV_BUCKETS = 20

XGBOOST_PARAMS: dict[str, Any] = {
    "eta": 0.05,
    "max_depth": 6,
    "subsample": 0.8,
    "colsample_bytree": 0.8,
    "min_child_weight": 5,
    "gamma": 0.2,
    "alpha": 0.01,
    "lambda": 0.1,
    "objective": "reg:squarederror",  # the chart's LATENCY_OBJECTIVE_TYPE "mean"
    "tree_method": "hist",
    "seed": 42,
    "nthread": 1,  # upstream uses every core; the fit is the same, and benches run in parallel
}
TREES = 200
"""The training server's frozen ``XGBRegressor`` settings (200 trees)."""


@dataclass(frozen=True)
class PredictorParams:
    model_sync_s: Annotated[float, Field(gt=0)] = 30.0
    """``MODEL_SYNC_INTERVAL_SEC`` of the chart's prediction servers."""
    min_samples: Annotated[int, Field(ge=1)] = 100
    """``LATENCY_MIN_SAMPLES_FOR_RETRAIN`` in the chart."""
    bucket_size: Annotated[int, Field(ge=1)] = 500
    """``LATENCY_MAX_TRAINING_DATA_SIZE_PER_BUCKET`` in the chart."""
    ensemble_min_split: Annotated[int, Field(ge=1)] = 200
    """``LATENCY_MIN_SAMPLES_FOR_ENSEMBLE_SPLIT``, the server's default."""
    test_ratio: Annotated[float, Field(ge=0, lt=1)] = 0.1
    """``LATENCY_TEST_TRAIN_RATIO``, the server's default."""


def model_columns(raw: FloatArray, queued: bool = True) -> FloatArray:
    """The training server's TTFT columns from raw rows: ``is_queued``, the raw features
    with the constant ones as zeros (so that column sampling draws from the same set),
    ``effective_input_tokens`` and the prefix bucket. Without the queue columns for the
    empty-queue model."""
    rows = len(raw)
    zeros = np.zeros(rows)
    prefix = np.clip(raw[:, PREFIX], 0.0, 1.0)
    columns = [
        (raw[:, WAITING] > 0).astype(np.float64),  # is_queued
        raw[:, KV],
        raw[:, INPUT],
        raw[:, WAITING],
        raw[:, RUNNING],
        raw[:, PREFILL_IN_FLIGHT],
        zeros,  # decode_tokens_in_flight: zero at dispatch upstream
        zeros,  # encoder_matched_size
        zeros,  # encoder_input_size
        raw[:, PREFIX],
        (1.0 - raw[:, PREFIX]) * raw[:, INPUT],  # effective_input_tokens
        np.minimum(prefix * PREFIX_BUCKETS, PREFIX_BUCKETS - 1).astype(np.int64).astype(float),
        zeros,  # pod_type_cat: monolithic
    ]
    if not queued:
        del columns[3], columns[0]  # num_request_waiting, is_queued
    return np.column_stack(columns)


def _feature_types(queued: bool) -> list[str]:
    kinds = ["q"] * 11 + ["c", "c"]  # the prefix bucket and pod type are categorical
    if not queued:
        del kinds[3], kinds[0]
    return kinds


def _fit(raw: FloatArray, ttft_ms: FloatArray, queued: bool) -> xgb.Booster:
    data = xgb.DMatrix(
        model_columns(raw, queued),
        label=ttft_ms,
        feature_types=_feature_types(queued),
        enable_categorical=True,
    )
    return xgb.train(XGBOOST_PARAMS, data, num_boost_round=TREES)


def _queue_bucket(waiting: float) -> int:
    """0, 1-2, 3-5, 6-10 and 11+ waiting requests."""
    return int(np.searchsorted([0, 2, 5, 10], waiting, side="left"))


def bucket_of(row: FloatArray) -> tuple[int, int, int]:
    kv = min(int(np.clip(row[KV], 0.0, 1.0) * KV_BUCKETS), KV_BUCKETS - 1)
    prefix = min(int(np.clip(row[PREFIX], 0.0, 1.0) * PREFIX_BUCKETS), PREFIX_BUCKETS - 1)
    return _queue_bucket(row[WAITING]), kv, prefix


@dataclass(frozen=True)
class _Model:
    """A synced model: one booster, or the gated ensemble's pair."""

    queued: xgb.Booster
    """Fitted on every sample, or (gated) on those taken with a waiting queue."""
    noqueue: xgb.Booster | None = None
    """The gated ensemble's booster for an empty queue, fitted without the queue columns."""

    def predict(self, raw: FloatArray) -> FloatArray:
        idle = raw[:, WAITING] == 0 if self.noqueue is not None else np.zeros(len(raw), bool)
        out = np.empty(len(raw))
        if self.noqueue is not None and idle.any():
            out[idle] = self.noqueue.inplace_predict(model_columns(raw[idle], queued=False))
        if (~idle).any():
            out[~idle] = self.queued.inplace_predict(model_columns(raw[~idle]))
        return out


class LatencyPredictor:
    """TTFT samples in, predictions (in ms) out; the clock is the host's."""

    def __init__(self, rng: np.random.Generator, params: PredictorParams | None = None) -> None:
        self.params = params or PredictorParams()
        self._rng = rng
        self._buckets: dict[tuple[int, int, int], deque[tuple[FloatArray, float]]] = {}
        self._since_fit = 0
        self._next_sync = self.params.model_sync_s
        self._model: _Model | None = None

    @property
    def ready(self) -> bool:
        return self._model is not None

    def add(self, raw: FloatArray, ttft_ms: float) -> None:
        """One training sample: the endpoint's features at dispatch and the TTFT seen, in
        whole milliseconds as the router reports it (zero is dropped, as upstream)."""
        if ttft_ms <= 0 or self._rng.random() < self.params.test_ratio:
            return
        bucket = self._buckets.setdefault(bucket_of(raw), deque(maxlen=self.params.bucket_size))
        bucket.append((raw, ttft_ms))
        self._since_fit += 1

    def tick(self, now: float) -> None:
        """At each of the prediction servers' syncs, the model the training server has
        fitted on what it holds by then (nothing new since the last fit: the same model)."""
        if now < self._next_sync:
            return
        self._next_sync = (now // self.params.model_sync_s + 1) * self.params.model_sync_s
        held = sum(len(bucket) for bucket in self._buckets.values())
        if held >= self.params.min_samples and self._since_fit > 0:
            self._model = self._train()
            self._since_fit = 0

    def predict(self, raw: FloatArray) -> FloatArray | None:
        """Predicted TTFT (ms) of each row, or None while no model is synced (503)."""
        return None if self._model is None else self._model.predict(raw)

    def _train(self) -> _Model:
        samples = [sample for bucket in self._buckets.values() for sample in bucket]
        raw = np.array([row for row, _ in samples])
        ttft = np.array([ttft for _, ttft in samples])
        idle = raw[:, WAITING] == 0
        split = self.params.ensemble_min_split
        if idle.sum() >= split and (~idle).sum() >= split:
            return _Model(
                queued=_fit(raw[~idle], ttft[~idle], queued=True),
                noqueue=_fit(raw[idle], ttft[idle], queued=False),
            )
        return _Model(queued=_fit(raw, ttft, queued=True))
