"""llm-d's predicted-latency profile and its latency predictor, checked by hand against the
upstream rules (``control/routing/predicted_latency.py`` names the sources)."""

from __future__ import annotations

import numpy as np
import pytest

from control.routing import FleetSnapshot, Observation, RouteRequest
from control.routing.latency_predictor import (
    RAW_FEATURES,
    LatencyPredictor,
    PredictorParams,
    bucket_of,
)
from control.routing.predicted_latency import LlmdPredictedLatency, PredictedLatencyParams

KV, INPUT, WAITING, RUNNING, PREFILL, PREFIX = range(len(RAW_FEATURES))


def fleet(waiting, kv_used=None) -> FleetSnapshot:
    n = len(waiting)
    return FleetSnapshot(
        tuple(f"i{k}" for k in range(n)),
        np.ones(n, dtype=bool),
        np.array(waiting, dtype=np.int64),
        np.zeros(n, dtype=np.int64),
        np.zeros(n, dtype=np.int64),
        np.array(kv_used if kv_used is not None else [0] * n, dtype=np.int64),
        np.full(n, 100, dtype=np.int64),
    )


class Predictions:
    """A predictor whose TTFTs (ms) the test sets: the profile's rules, without a model."""

    def __init__(self, ttft_ms: list[float] | None) -> None:
        self.ttft_ms = None if ttft_ms is None else np.array(ttft_ms, dtype=float)

    def tick(self, now: float) -> None:
        pass

    def predict(self, raw: np.ndarray) -> np.ndarray | None:
        return self.ttft_ms


def router(ttft_ms: list[float] | None, seed: int = 0, **params) -> LlmdPredictedLatency:
    built = LlmdPredictedLatency(np.random.default_rng(seed), PredictedLatencyParams(**params))
    built.predictor = Predictions(ttft_ms)  # type: ignore[assignment]
    return built


def request(name: str = "r", blocks: tuple[int, ...] = (1, 2, 3, 4)) -> RouteRequest:
    return RouteRequest(name, input_tokens=16 * len(blocks), output_budget=8, prefix_blocks=blocks)


def picks(make, snapshot: FleetSnapshot, seeds: int = 400) -> np.ndarray:
    """How often each row is chosen over ``seeds`` fresh routers."""
    counts = np.zeros(len(snapshot))
    for seed in range(seeds):
        chosen = make(seed).route(request(f"r{seed}"), snapshot, 0.0).chosen
        counts[chosen] += 1
    return counts / seeds


# --- the latency predictor -------------------------------------------------------------


def true_ttft_ms(raw: np.ndarray) -> np.ndarray:
    return 40.0 + 150.0 * raw[:, WAITING] + 0.05 * raw[:, PREFILL] + 0.02 * raw[:, INPUT]


def samples(n: int, rng: np.random.Generator, queued_share: float = 0.5) -> np.ndarray:
    raw = np.zeros((n, len(RAW_FEATURES)))
    raw[:, KV] = rng.random(n)
    raw[:, INPUT] = rng.integers(100, 8000, n)
    raw[:, WAITING] = np.where(rng.random(n) < queued_share, rng.integers(1, 8, n), 0)
    raw[:, RUNNING] = rng.integers(0, 30, n)
    raw[:, PREFILL] = rng.integers(0, 20_000, n)
    raw[:, PREFIX] = rng.random(n)
    return raw


def test_no_model_answers_before_the_first_sync_after_enough_samples() -> None:
    predictor = LatencyPredictor(np.random.default_rng(0), PredictorParams(test_ratio=0.0))
    raw = samples(150, np.random.default_rng(1))
    for row, ttft in zip(raw[:99], true_ttft_ms(raw[:99]), strict=True):
        predictor.add(row, float(ttft))
    predictor.tick(30.0)  # a sync with 99 samples: nothing to fit
    assert predictor.predict(raw) is None
    for row, ttft in zip(raw[99:], true_ttft_ms(raw[99:]), strict=True):
        predictor.add(row, float(ttft))
    predictor.tick(59.9)  # enough samples, but the prediction servers sync at 60 s
    assert predictor.predict(raw) is None
    predictor.tick(60.0)
    assert predictor.predict(raw) is not None


def test_the_predictor_learns_ttft_and_splits_by_queue_once_both_sides_have_200() -> None:
    rng = np.random.default_rng(2)
    predictor = LatencyPredictor(np.random.default_rng(0))
    train = samples(3000, rng)
    for row, ttft in zip(train, true_ttft_ms(train), strict=True):
        predictor.add(row, float(ttft))
    predictor.tick(30.0)
    assert predictor._model is not None
    assert predictor._model.noqueue is not None  # the gated ensemble
    probe = samples(500, rng)
    predicted = predictor.predict(probe)
    assert predicted is not None
    error = np.abs(predicted - true_ttft_ms(probe)) / true_ttft_ms(probe)
    assert np.median(error) < 0.1


def test_one_model_serves_while_either_side_of_the_queue_has_under_200() -> None:
    predictor = LatencyPredictor(np.random.default_rng(0), PredictorParams(test_ratio=0.0))
    train = samples(1000, np.random.default_rng(3), queued_share=0.1)
    train[:, WAITING] = np.where(np.arange(1000) < 150, 3, 0)  # 150 queued, 850 not
    for row, ttft in zip(train, true_ttft_ms(train), strict=True):
        predictor.add(row, float(ttft))
    predictor.tick(30.0)
    assert predictor._model is not None
    assert predictor._model.noqueue is None


def test_a_bucket_keeps_its_newest_500_and_a_tenth_is_held_out() -> None:
    predictor = LatencyPredictor(np.random.default_rng(0))
    row = samples(1, np.random.default_rng(4))[0]
    for k in range(2000):
        predictor.add(row, float(k + 1))
    kept = predictor._buckets[bucket_of(row)]
    assert len(kept) == 500
    assert kept[-1][1] == 2000.0  # the oldest are dropped
    predictor = LatencyPredictor(np.random.default_rng(0), PredictorParams(bucket_size=10**6))
    for k in range(2000):
        predictor.add(row, float(k + 1))
    assert 1700 < len(predictor._buckets[bucket_of(row)]) < 1900  # about 10 % held out


def test_samples_are_bucketed_by_queue_kv_in_twentieths_and_prefix_in_quarters() -> None:
    row = np.zeros(len(RAW_FEATURES))
    row[[WAITING, KV, PREFIX]] = 2, 0.37, 0.99
    assert bucket_of(row) == (1, 7, 3)
    row[[WAITING, KV, PREFIX]] = 11, 1.0, 0.25
    assert bucket_of(row) == (4, 19, 1)
    row[WAITING] = 6
    assert bucket_of(row)[0] == 3


def test_a_zero_millisecond_ttft_is_no_sample() -> None:
    predictor = LatencyPredictor(np.random.default_rng(0), PredictorParams(test_ratio=0.0))
    predictor.add(samples(1, np.random.default_rng(5))[0], 0.0)
    assert not predictor._buckets


# --- the profile -----------------------------------------------------------------------


def test_without_predictions_the_strict_filter_keeps_the_sticky_endpoint() -> None:
    def make(seed: int) -> LlmdPredictedLatency:
        built = router(None, seed)
        built._prefix.index.add(2, [1, 2, 3, 4])  # a full match on i2 only
        return built

    assert picks(make, fleet([0, 0, 9]), seeds=50).tolist() == [0.0, 0.0, 1.0]


def test_without_predictions_the_composite_fallback_weights_kv_queue_and_prefix() -> None:
    """kv free 1, 0.5, 1; relative queue 1, 1, 0 (the most waiting is 4): composite
    2/3, 1/2, 1/3, so the picker's odds are 67 : 50 : 33 (rounded to hundredths)."""
    built = router(None)
    decision = built.route(request(), fleet([0, 0, 4], kv_used=[0, 50, 0]), 0.0)
    np.testing.assert_allclose(-decision.scores, [0.67, 0.5, 0.33])
    share = picks(lambda seed: router(None, seed), fleet([0, 0, 4], kv_used=[0, 50, 0]), 3000)
    np.testing.assert_allclose(share, np.array([67, 50, 33]) / 150, atol=0.03)


def test_the_least_predicted_ttft_scores_101_and_the_most_1() -> None:
    """Every endpoint violates the 0 ms objective and all are busy: weights
    int((1 - n) x 100) + 1 over the headroom's spread, n = 0, 0.25, 1."""
    built = router([100.0, 200.0, 500.0])
    for row in range(3):
        built._requests.dispatched(f"busy{row}", row)
    decision = built.route(request(), fleet([1, 1, 1]), 0.0)
    np.testing.assert_allclose(-decision.scores, [1.01, 0.76, 0.01])
    np.testing.assert_allclose(decision.predicted_ttft_s, [0.1, 0.2, 0.5])


def test_the_picker_draws_in_proportion_to_the_scores() -> None:
    def make(seed: int) -> LlmdPredictedLatency:
        built = router([100.0, 300.0], seed)
        built._requests.dispatched("a", 0)
        built._requests.dispatched("b", 1)
        return built

    share = picks(make, fleet([1, 1]), seeds=3000)  # weights 101 and 1
    assert share[0] == pytest.approx(101 / 102, abs=0.01)
    assert share[1] > 0


def test_idle_endpoints_are_scored_first_when_all_violate_the_objective() -> None:
    built = router([100.0, 900.0, 400.0])
    built._requests.dispatched("a", 0)  # i0 is busy with this router's request
    decision = built.route(request(), fleet([0, 0, 0]), 0.0)
    assert decision.chosen in (1, 2)
    assert -decision.scores[0] == 0.0


def test_endpoints_within_the_objective_come_first() -> None:
    built = router([100.0, 900.0, 400.0], ttft_objective_ms=500.0, explore_violating=0.0)
    for row in range(3):
        built._requests.dispatched(f"busy{row}", row)
    decision = built.route(request(), fleet([1, 1, 1]), 0.0)
    assert decision.chosen in (0, 2)
    assert decision.scores[1] == 1.0  # filtered out: ranked after every kept endpoint


def test_a_sticky_endpoint_predicted_over_5_s_slower_loses_its_affinity() -> None:
    def make(ttft: list[float]):
        def build(seed: int) -> LlmdPredictedLatency:
            built = router(ttft, seed)
            built._prefix.index.add(0, [1, 2, 3, 4])
            return built

        return build

    assert picks(make([5100.0, 50.0]), fleet([0, 0]), 50)[1] > 0  # the gate breaks
    assert picks(make([5000.0, 50.0]), fleet([0, 0]), 50).tolist() == [1.0, 0.0]


def test_the_loose_filter_keeps_partial_matches_of_80_percent() -> None:
    def make(seed: int) -> LlmdPredictedLatency:
        built = router([100.0, 100.0, 100.0], seed)
        built._prefix.index.add(1, [1, 2, 3, 4, 5, 6, 7, 8])  # 8 of 10 blocks: 0.8
        return built

    blocks = tuple(range(1, 11))
    for seed in range(20):
        chosen = make(seed).route(request("r", blocks), fleet([0, 0, 0]), 0.0).chosen
        assert chosen == 1


def test_the_index_and_the_in_flight_load_follow_the_instance_routed_to() -> None:
    built = router([900.0, 100.0])
    built._prefix.index.add(0, [1, 2])
    for row in range(2):
        built._requests.dispatched(f"busy{row}", row)
    decision = built.route(request("r", (1, 2, 3, 4)), fleet([1, 1]), 0.0)
    row = decision.chosen
    assert built._prefix.index.match((1, 2, 3, 4), 2)[row] == 4
    assert built._requests.counts(2)[row] == 2
    assert built._prefill.prefill_tokens(2)[row] > 0
    built.first_token("r")
    assert built._prefill.prefill_tokens(2)[row] == 0  # prefill tokens leave at the first token
    assert built._requests.counts(2)[row] == 2
    built.ended("r")
    assert built._requests.counts(2)[row] == 1  # the request at the end


def test_a_sample_pairs_the_chosen_endpoints_features_with_the_ttft_in_whole_ms() -> None:
    built = LlmdPredictedLatency(np.random.default_rng(0), PredictedLatencyParams(test_ratio=0.0))
    decision = built.route(request(), fleet([3, 0]), 0.0)
    built.observe(Observation("r", decision.chosen, 0.1237, 8))
    [kept] = built.predictor._buckets.values()
    row, ttft = kept[0]
    assert ttft == 123.0
    assert row[WAITING] == [3, 0][decision.chosen]
    assert row[INPUT] == 64
