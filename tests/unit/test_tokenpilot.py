from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from control.routing import FleetSnapshot, Observation, PoolModel, RouteRequest, make_router
from control.routing.estimators import AwaitingOutcome, OutputLengths, TokenLag
from control.routing.llmd import LlmdDefault
from control.routing.tokenpilot import TokenPilot, TokenPilotParams
from control.step_time import KneeRoofline
from schemas.openai_api import DEFAULT_CHAT_TOKENS

STEPS = KneeRoofline(
    a_s=0.015,
    b_s_per_token=30e-6,
    n0_tokens=150,
    c_s_per_seq=7e-6,
    d_s_per_context_token=2.5e-8,
    e_s_per_prefill_pair=1.5e-9,
    ttft_overhead_s=0.02,
)
POOL = PoolModel(STEPS)
PREFIX = tuple(range(504))  # 8,064 tokens of shared prompt, whole groups of 4 and 8 blocks


def idle_fleet(size: int) -> FleetSnapshot:
    zeros = np.zeros(size, dtype=np.int64)
    return FleetSnapshot(
        tuple(f"i{n}" for n in range(size)),
        np.ones(size, dtype=bool),
        zeros,
        zeros,
        zeros,
        zeros,
        np.full(size, 30_000, dtype=np.int64),
    )


def hot_request(n: int) -> RouteRequest:
    return RouteRequest(f"r{n}", input_tokens=8_264, output_budget=200, prefix_blocks=PREFIX)


def test_a_warm_instance_with_a_short_queue_wins() -> None:
    pilot = TokenPilot(POOL)
    pilot.index.add(1, PREFIX)
    decision = pilot.route(hot_request(0), idle_fleet(3), now=0.0)
    assert decision.chosen == 1
    assert decision.parts["cached_tokens"][1] == 8_064
    assert decision.parts["prefill_s"][1] < decision.parts["prefill_s"][0] / 10


def test_blocks_an_engine_reports_evicted_no_longer_draw_requests() -> None:
    pilot = TokenPilot(POOL)
    pilot.index.add(1, PREFIX)
    stride = pilot.params.index_stride
    evicted = [(block, False) for block in PREFIX[len(PREFIX) // 2 :]]
    pilot.kv_events(1, [(block, True) for block in PREFIX[:8]] + evicted)
    decision = pilot.route(hot_request(0), idle_fleet(3), now=0.0)
    assert decision.parts["cached_tokens"][1] == (len(PREFIX) // 2 // stride) * stride * 16
    pilot.kv_events(1, [(block, False) for block in PREFIX])
    decision = pilot.route(hot_request(1), idle_fleet(3), now=0.0)
    assert decision.parts["cached_tokens"][decision.chosen] == 0


def test_a_cold_instance_wins_once_the_warm_queue_costs_more_than_the_prefill_saved() -> None:
    pilot = TokenPilot(POOL)
    pilot.index.add(0, PREFIX)
    fleet = idle_fleet(4)
    chosen = []
    for n in range(300):  # a burst: all arrive at once, so the queues only grow
        decision = pilot.route(hot_request(n), fleet, now=0.0)
        chosen.append(decision.chosen)
        parts = decision.parts
        score = (parts["queue_s"] + parts["prefill_s"]) * parts["correction"]
        score = score + parts["delay_to_others_s"]
        # queue, prefill and delay, weighed; within the tie band of the best
        assert score[decision.chosen] <= score.min() * (1 + pilot.params.tie_band)
    # each warm request adds ~6 ms of queue; a cold copy costs its ~317 ms prefill plus
    # the delay it adds to the requests queued behind it (~0.19 s by then): ~70 fit first
    first_cold = next(n for n, c in enumerate(chosen) if c != 0)
    assert 60 <= first_cold <= 80
    assert len(set(chosen)) >= 3, "then the hot prefix spreads as its homes' queues grow"
    assert max(chosen.count(i) for i in set(chosen)) < len(chosen) / 2


def test_a_miss_costs_more_when_every_instance_has_a_queue() -> None:
    """The warm instance has two prompts more queued than the cold ones in both cases. On
    an otherwise idle pool that queue costs more than the prefill a miss adds, so a cold
    instance wins; when every instance has a queue, the miss's prefill also delays all the
    requests queued behind it, and the warm instance wins."""

    def choice(waiting: list[int]) -> int | None:
        pilot = TokenPilot(POOL)
        pilot.index.add(0, PREFIX)
        busy = replace(idle_fleet(3), waiting=np.array(waiting))
        return pilot.route(hot_request(0), busy, now=0.0).chosen

    assert choice([2, 0, 0]) in (1, 2)
    assert choice([8, 6, 6]) == 0


def test_llmd_default_piles_the_same_burst_onto_the_prefix_home() -> None:
    router = LlmdDefault(np.random.default_rng(0))
    router.index.add(0, PREFIX)
    fleet = idle_fleet(4)  # scraped metrics do not move within a burst
    assert {router.route(hot_request(n), fleet, now=0.0).chosen for n in range(100)} == {0}


def _observe_truth(pilot: TokenPilot, fleet: FleetSnapshot, n: int, ratio: float) -> None:
    """Route a request on ``fleet`` and report a TTFT ``ratio`` times the raw prediction."""
    request = RouteRequest(f"r{n}", 2_000, 50)
    decision = pilot.route(request, fleet, now=float(n))
    assert decision.chosen is not None
    raw = (decision.parts["queue_s"] + decision.parts["prefill_s"])[decision.chosen]
    truth = ratio * raw + STEPS.ttft_overhead_s
    pilot.observe(Observation(request.request_id, decision.chosen, truth, 50))


def test_the_bias_correction_converges_to_each_instance_s_observed_ratio() -> None:
    """Instance 0 runs twice as slow as predicted, instance 1 twice as fast: the pool's
    part settles between them, and each instance's own deviation, learned slowly, takes
    it the rest of the way."""
    pilot = TokenPilot(POOL)
    both = idle_fleet(2)
    for n in range(2_000):  # only one instance is ready at a time, so both get observed
        fleet = replace(both, ready=np.array([n % 2 == 0, n % 2 == 1]))
        _observe_truth(pilot, fleet, n, {0: 2.0, 1: 0.5}[n % 2])
    np.testing.assert_allclose(
        pilot.route(RouteRequest("x", 10, 1), both, 1e6).parts["correction"], [2.0, 0.5], rtol=0.05
    )


def test_a_bias_seen_on_one_instance_corrects_the_whole_pool_at_once() -> None:
    """An instance that has had no request yet is predicted with the pool's ratio."""
    pilot = TokenPilot(POOL)
    only_first = replace(idle_fleet(4), ready=np.array([True, False, False, False]))
    for n in range(50):
        _observe_truth(pilot, only_first, n, 1.5)
    correction = pilot.route(RouteRequest("x", 10, 1), idle_fleet(4), 1e6).parts["correction"]
    np.testing.assert_allclose(correction, 1.5, rtol=0.05)


def test_a_tie_goes_to_the_candidate_with_the_fewest_tokens_in_flight() -> None:
    """The host's count of tokens in flight is shared by every gateway replica, where each
    replica's own turns are not: replicas that took turns alone would pile a burst's cold
    prefixes onto whichever instance came first in each one's order."""
    pilot = TokenPilot(POOL)
    shared = replace(idle_fleet(4), inflight_tokens=np.array([900, 300, 600, 300]))
    decision = pilot.route(RouteRequest("r", 100, 10), shared, now=0.0)
    assert decision.scores.max() <= decision.scores.min() * (1 + pilot.params.tie_band)
    assert decision.chosen == 1  # fewest in flight; of 1 and 3, the first in turn


def test_candidates_within_the_tie_band_take_turns() -> None:
    """A few running sequences more or less (a score 0.1 % higher) is a tie: a burst goes
    round the instances. Sixty more (5 % higher) is not: the idle one takes every request."""
    pilot = TokenPilot(POOL)
    near = replace(idle_fleet(4), running=np.array([3, 0, 2, 1]))
    burst = [RouteRequest(f"r{n}", 100, 10) for n in range(8)]
    chosen = [pilot.route(r, near, now=n * 10.0).chosen for n, r in enumerate(burst)]
    assert chosen == [0, 1, 2, 3, 0, 1, 2, 3]
    far = replace(idle_fleet(4), running=np.array([60, 60, 0, 60]))
    chosen = [pilot.route(r, far, now=1e3 + n * 10.0).chosen for n, r in enumerate(burst)]
    assert set(chosen) == {2}


def test_every_candidate_s_terms_are_in_the_decision_record() -> None:
    pilot = TokenPilot(POOL)
    fleet = idle_fleet(3)
    decision = pilot.route(hot_request(0), fleet, now=0.0)
    [candidate, *_] = decision.candidates(fleet)
    assert {name for name, _ in candidate.parts} >= {
        "queue_s",
        "prefill_s",
        "cached_tokens",
        "work_s",
        "delay_to_others_s",
        "correction",
        "tpot_s",
        "kv_pressure",
    }


def test_a_fuller_kv_cache_weighs_a_candidate_s_time_up_to_double() -> None:
    pilot = TokenPilot(POOL)
    fleet = replace(idle_fleet(2), kv_blocks_used=np.array([18_000, 0]))  # 60 % and empty
    decision = pilot.route(RouteRequest("r", 8_200, 200), fleet, now=0.0)
    np.testing.assert_allclose(decision.parts["kv_pressure"], [1.6, 1.0])
    assert decision.chosen == 1
    unweighed = decision.parts["predicted_ttft_s"] + decision.parts["delay_to_others_s"]
    np.testing.assert_allclose(decision.scores, unweighed * [1.6, 1.0])
    pilot.index.add(0, PREFIX)  # a cached 8,064-token prefix saves more than the pressure costs
    assert pilot.route(hot_request(1), fleet, now=10.0).chosen == 0


def test_an_instance_without_free_blocks_for_the_uncached_prompt_is_skipped() -> None:
    pilot = TokenPilot(POOL)
    pilot.index.add(0, PREFIX)  # 200 uncached tokens there (13 blocks), 8,264 elsewhere
    fleet = replace(idle_fleet(3), kv_blocks_used=np.array([29_990, 29_000, 29_600]))
    decision = pilot.route(hot_request(0), fleet, now=0.0)
    assert decision.scores[0] < decision.scores[1]  # the warm one would be faster...
    assert decision.chosen == 1  # ...but only instance 1 has room (517 blocks) for its part


def test_free_blocks_are_counted_in_each_engine_s_own_block_size() -> None:
    """The warm instance pages KV in blocks of 64 tokens (FlashMLA's): its 4 free blocks
    hold the 200 uncached tokens, which would take 13 blocks of the pool's 16."""
    pilot = TokenPilot(POOL)
    pilot.index.add(0, PREFIX)
    fleet = replace(
        idle_fleet(3),
        kv_blocks_used=np.array([7_496, 29_000, 29_600]),
        kv_blocks_total=np.array([7_500, 30_000, 30_000]),
        kv_block_size=np.array([64, 16, 16]),
    )
    assert pilot.route(hot_request(0), fleet, now=0.0).chosen == 0


def test_the_prefix_index_holds_what_the_engine_s_blocks_of_64_hold() -> None:
    """10 blocks of 64 tokens hold 40 prefix blocks of 16: a 32-block prefix stays whole."""
    pilot = TokenPilot(POOL)
    small = replace(idle_fleet(1), kv_blocks_total=np.array([10]), kv_block_size=np.array([64]))
    prefix = tuple(range(32))
    pilot.route(RouteRequest("r", 600, 10, prefix_blocks=prefix), small, now=0.0)
    assert pilot.index.match(prefix, 1).tolist() == [32]


def test_an_engine_reuses_whole_blocks_of_its_own_size() -> None:
    """Five 16-token prefix blocks match: 80 tokens, of which an engine paging in blocks of
    64 holds one whole block."""
    pilot = TokenPilot(POOL, TokenPilotParams(index_stride=1))
    pilot.index.add(0, PREFIX[:5])
    pilot.index.add(1, PREFIX[:5])
    fleet = replace(idle_fleet(2), kv_block_size=np.array([16, 64]))
    cached = pilot.route(hot_request(0), fleet, now=0.0).parts["cached_tokens"]
    assert cached.tolist() == [80, 64]


def test_context_is_counted_in_each_engine_s_own_block_size() -> None:
    """Two instances alike in tokens: 64,000 in use of 480,000, one in blocks of 16, the
    other in blocks of 64. Their decode steps cost the same, and so do they."""
    pilot = TokenPilot(POOL)
    fleet = replace(
        idle_fleet(2),
        running=np.array([8, 8]),
        kv_blocks_used=np.array([4_000, 1_000]),
        kv_blocks_total=np.array([30_000, 7_500]),
        kv_block_size=np.array([16, 64]),
    )
    scores = pilot.route(hot_request(0), fleet, now=0.0).scores
    assert scores[0] == pytest.approx(scores[1])


def test_it_degrades_to_the_best_ready_instance_when_every_one_is_full() -> None:
    pilot = TokenPilot(POOL)
    full = replace(
        idle_fleet(3),
        ready=np.array([True, True, False]),  # the idle one cannot take it
        waiting=np.array([2, 0, 0]),  # two prompts queue on the first
        kv_blocks_used=np.array([29_900, 29_950, 0]),
    )
    decision = pilot.route(hot_request(0), full, now=0.0)
    assert decision.scores[1] < decision.scores[0] * 0.9
    assert decision.chosen == 1


def test_a_withdrawn_decision_no_longer_counts_as_work_sent() -> None:
    pilot = TokenPilot(POOL)
    fleet = idle_fleet(2)
    first = pilot.route(RouteRequest("r0", 4_000, 50), fleet, now=0.0)
    busy = pilot.route(RouteRequest("r1", 4_000, 50), fleet, now=0.0)
    assert busy.parts["ahead_tokens"][first.chosen] == 4_000
    pilot.withdraw("r0")  # the host routed r0 elsewhere after all
    pilot.withdraw("r1")
    again = pilot.route(RouteRequest("r2", 4_000, 50), fleet, now=0.0)
    assert again.parts["ahead_tokens"].tolist() == [0.0, 0.0]


def test_tokenpilot_cannot_be_made_without_the_pool_s_step_model() -> None:
    with pytest.raises(ValueError, match="prices queues on the pool's step model"):
        make_router("tokenpilot")


def test_a_scraped_queue_the_ledger_cannot_see_counts_too() -> None:
    pilot = TokenPilot(POOL)
    idle = idle_fleet(2)
    busy = replace(idle, waiting=np.array([12, 0]))
    decision = pilot.route(RouteRequest("r", 4_000, 50), busy, now=0.0)
    assert decision.parts["ahead_tokens"][0] > 0
    assert decision.parts["queue_s"][0] > decision.parts["queue_s"][1] == 0.0
    assert decision.chosen == 1


def test_requests_whose_outcome_never_comes_are_forgotten_oldest_first() -> None:
    awaiting: AwaitingOutcome[int] = AwaitingOutcome(capacity=3)
    for n in range(5):
        awaiting.put(f"r{n}", n)
    assert len(awaiting) == 3
    assert awaiting.pop("r1") is None
    assert awaiting.pop("r4") == 4


UNLAGGED = TokenPilotParams(token_lag_s=0.0)
"""The host sees tokens the moment their step ends."""


def _stepping(size: int, began: list[float]) -> FleetSnapshot:
    """An idle-queued fleet whose instances each began a step at ``began`` (the host saw
    their last tokens then), with 40 sequences decoding on each."""
    return replace(
        idle_fleet(size),
        running=np.full(size, 40),
        last_step_end_s=np.array(began, dtype=float),
    )


def test_a_request_goes_where_the_step_in_flight_ends_soonest() -> None:
    """A queue-blind router sees two equal instances; the host has seen one of them
    begin its step 1 ms ago and the other 14 ms ago: the second frees its next step
    sooner."""
    pilot = TokenPilot(POOL, UNLAGGED)
    decode_step = STEPS.step_s(0, 0, 41, 0)
    decision = pilot.route(RouteRequest("r", 300, 50), _stepping(2, [0.014, 0.001]), now=0.015)
    np.testing.assert_allclose(decision.parts["wait_s"], [decode_step - 0.001, decode_step - 0.014])
    assert decision.chosen == 1


def test_a_request_sent_since_the_step_began_shares_the_next_step_with_the_next_one() -> None:
    """A short prompt sent to instance 0 after its step began waits for the next step;
    a long prompt sent there too would join that step and delay the short one's first
    token by its whole first chunk, which the score counts: the long one goes to
    instance 1, though that one's step ends 13 ms later."""
    pilot = TokenPilot(POOL, UNLAGGED)
    assert pilot.route(RouteRequest("short", 200, 50), _stepping(2, [0, 0]), now=0.009).chosen == 0
    decision = pilot.route(RouteRequest("long", 4_000, 50), _stepping(2, [0, 0.013]), now=0.014)
    parts = decision.parts
    assert parts["unstarted_ahead"].tolist() == [1, 0]
    assert parts["unstarted_tokens"].tolist() == [200, 0]
    added = STEPS.step_s(4_200, 0, 40, 0) - STEPS.step_s(200, 0, 40, 0)
    np.testing.assert_allclose(parts["shared_step_s"][0], added)
    assert parts["wait_s"][1] - parts["wait_s"][0] > 0.012  # far more than 200 tokens cost
    assert decision.chosen == 1
    later = pilot.route(RouteRequest("next", 4_000, 50), _stepping(2, [0.03, 0.03]), now=0.031)
    assert later.parts["unstarted_ahead"].tolist() == [0, 0]  # both are in a later step


def test_without_a_boundary_seen_within_a_step_the_whole_queue_ahead_is_waited_for() -> None:
    """No tokens streamed for longer than the work in flight would take (a long prompt's
    chunks, or only non-streamed answers): the phase is unknown."""
    pilot = TokenPilot(POOL, UNLAGGED)
    pending = replace(_stepping(2, [0.0, 0.49]), pending_prefill_tokens=np.array([4e3, 0]))
    stale = pilot.route(RouteRequest("r", 300, 50), pending, now=0.5)
    queue = STEPS.step_s(4_000, 0, 40, 0)
    decode_step = STEPS.step_s(0, 0, 41, 0)
    np.testing.assert_allclose(stale.parts["wait_s"], [0.0, decode_step - 0.01])
    np.testing.assert_allclose(stale.parts["queue_s"], [queue, decode_step - 0.01])
    assert stale.parts["unstarted_ahead"].tolist() == [0, 0]


def test_a_step_end_seen_late_is_placed_back_by_the_lag() -> None:
    """The host sees tokens 2 ms after their step ends. Instance 0's step was seen ending
    11 ms ago, so it began 13 ms ago and has 2 ms to go. Instance 1's, seen 14 ms ago,
    began 16 ms ago: it has ended unseen, and the next decoding step has barely begun. A
    router that took the tokens' arrival for the step's end would choose instance 1."""
    decode_step = STEPS.step_s(0, 0, 41, 0)  # 15.3 ms
    fleet = _stepping(2, [0.009, 0.006])
    request = RouteRequest("r", 300, 50)
    decision = TokenPilot(POOL, TokenPilotParams(token_lag_s=0.002)).route(request, fleet, 0.02)
    expected = [decode_step - 0.013, decode_step - (0.016 - decode_step)]
    np.testing.assert_allclose(decision.parts["wait_s"], expected)
    assert decision.chosen == 0
    assert TokenPilot(POOL, UNLAGGED).route(request, fleet, now=0.02).chosen == 1


def test_a_withdrawn_request_no_longer_counts_as_unstarted() -> None:
    pilot = TokenPilot(POOL, UNLAGGED)
    fleet = _stepping(2, [0.0, 0.0])
    first = pilot.route(RouteRequest("r0", 300, 50), fleet, now=0.001)
    second = pilot.route(RouteRequest("r1", 300, 50), fleet, now=0.002)
    assert second.parts["unstarted_ahead"][first.chosen] == 1
    pilot.withdraw("r0")
    third = pilot.route(RouteRequest("r2", 300, 50), fleet, now=0.003)
    assert third.parts["unstarted_ahead"].sum() == 1  # r1 alone


STEP_S = 0.02


def _waits(lag: TokenLag, host_lag_s: float, samples: int, seed: int = 0) -> None:
    """Requests sent with nothing queued, each where a router assuming ``lag`` expects
    it to catch the next step (the host saw the last step end no longer ago than a step
    less that lag); each waits for its first step as a host ``host_lag_s`` late makes it,
    plus a constant 3 ms the rest of the prediction missed and 1 ms of noise."""
    rng = np.random.default_rng(seed)
    for _ in range(samples):
        age = rng.uniform(0, STEP_S - lag.lag_s)
        wait = (STEP_S - age - host_lag_s) % STEP_S + 0.003 + rng.normal(0, 0.001)
        lag.observe(age, STEP_S, wait)


@pytest.mark.parametrize(("floor_s", "host_lag_s"), [(0.004, 0.008), (0.0, 0.002)])
def test_the_lag_rises_to_a_host_later_than_assumed(floor_s: float, host_lag_s: float) -> None:
    lag = TokenLag(floor_s=floor_s)
    _waits(lag, host_lag_s=host_lag_s, samples=512)
    assert lag.lag_s == pytest.approx(host_lag_s, abs=0.00075)


def test_a_host_earlier_than_the_floor_keeps_the_lag_at_the_floor() -> None:
    """Assuming 4 ms, the router never sends where a 2 ms lag would show."""
    lag = TokenLag(floor_s=0.004)
    _waits(lag, host_lag_s=0.002, samples=1_024)
    assert lag.lag_s == 0.004


def test_a_host_that_became_faster_is_followed_back_down_to_the_floor() -> None:
    lag = TokenLag(floor_s=0.002)
    _waits(lag, host_lag_s=0.008, samples=256)
    assert lag.lag_s > 0.0075
    _waits(lag, host_lag_s=0.002, samples=64 * 160, seed=1)
    assert lag.lag_s == pytest.approx(0.002, abs=0.0005)


def test_before_its_first_fit_the_lag_is_the_floor() -> None:
    lag = TokenLag(floor_s=0.004)
    _waits(lag, host_lag_s=0.008, samples=63)
    assert lag.lag_s == 0.004


def test_the_output_estimate_learns_and_a_missing_budget_caps_nothing() -> None:
    outputs = OutputLengths()
    assert outputs.expected("chat", None) == DEFAULT_CHAT_TOKENS  # nothing seen, no cap
    assert outputs.expected("chat", 100) == 50  # nothing seen: half the client's cap
    outputs.observe("chat", 900)
    assert outputs.expected("chat", None) == 900  # learned, not cut to a guess
    assert outputs.expected("chat", 300) == 300  # a client's cap still caps


def _busy_fleet(n: int) -> FleetSnapshot:
    """Three instances with scraped queues that change every few requests, so that the
    mean prompt, which sizes them, matters; one step end seen per instance."""
    rng = np.random.default_rng(n // 3)
    fleet = idle_fleet(3)
    waiting = rng.integers(0, 4, 3)
    return replace(
        fleet,
        waiting=waiting,
        running=rng.integers(0, 40, 3),
        kv_blocks_used=rng.integers(0, 20_000, 3),
        last_step_end_s=n * 0.01 - rng.uniform(0, 0.05, 3),
    )


def test_routing_after_admission_s_prediction_decides_as_routing_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``predict_ttft`` keeps its terms for the ``route`` that follows on the same view:
    a router asked first must decide every request as one that was not, through scraped
    queues sized by a moving mean, narrowed snapshots, releases from a pool, first tokens
    and evictions."""
    asked, alone = TokenPilot(POOL), TokenPilot(POOL)
    passes = {id(asked): 0, id(alone): 0}
    predict = TokenPilot._predict

    def counted(pilot: TokenPilot, *args: Any) -> dict[str, np.ndarray]:
        passes[id(pilot)] += 1
        return predict(pilot, *args)

    monkeypatch.setattr(TokenPilot, "_predict", counted)
    rng = np.random.default_rng(7)
    chosen = 0
    for n in range(400):
        prompt = int(rng.integers(100, 12_000))
        blocks = PREFIX[: int(rng.integers(0, len(PREFIX)))]
        request = RouteRequest(
            f"r{n}", input_tokens=prompt, output_budget=200, prefix_blocks=blocks
        )
        fleet, now = _busy_fleet(n), n * 0.01
        asked.predict_ttft(request, fleet, now)
        if n % 6 == 1:  # held by admission, routed when released
            now += 0.002
        if n % 5 == 0:  # admission allowed two instances of three
            fleet = replace(fleet, ready=np.array([True, False, True]))
        for pilot in (asked, alone):  # what the host heard between prediction and route
            if n % 7 == 3:
                pilot.kv_events(0, [(block, False) for block in PREFIX[:64]])
            if n % 2 == 1:  # the previous request's first token, later than predicted
                pilot.observe(Observation(f"r{n - 1}", chosen, ttft_s=0.5, output_tokens=150))
            if n % 11 == 4:  # the one before, routed elsewhere after all
                pilot.withdraw(f"r{n - 2}")
        mine, theirs = asked.route(request, fleet, now), alone.route(request, fleet, now)
        assert mine.chosen == theirs.chosen
        assert mine.parts.keys() == theirs.parts.keys()
        for name, values in mine.parts.items():
            np.testing.assert_array_equal(values, theirs.parts[name], err_msg=name)
        chosen = mine.chosen or 0
    # One pass each for the router routing alone; the asked one's routes reused some of
    # its predictions and computed the rest again.
    assert passes[id(alone)] == 400
    assert 400 + 100 < passes[id(asked)] < 800


def test_admission_is_told_the_request_s_own_ttft_on_an_idle_instance() -> None:
    """What no wait shortens: the prompt's prefill on the best ready instance, its cache
    as it is; on an idle fleet, the best of the predictions."""
    pilot = TokenPilot(POOL)
    on_idle = pilot.predict_ttft(hot_request(0), idle_fleet(3), 0.0)
    assert on_idle.idle_s == pytest.approx(on_idle.on_each.min())
    pilot.route(hot_request(0), idle_fleet(3), 0.0)  # its prefix cached where it went
    busy = _busy_fleet(9)
    warm = pilot.predict_ttft(hot_request(1), busy, 0.1)
    assert warm.idle_s < on_idle.idle_s / 2  # 8,064 of its 8,264 tokens cached
    assert warm.idle_s < warm.on_each.min()
    none_ready = replace(busy, ready=np.zeros(3, dtype=bool))
    assert pilot.predict_ttft(hot_request(2), none_ready, 0.2).idle_s == np.inf
