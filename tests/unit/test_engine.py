from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control.admission.registry import EngineScheduling
from control.step_time import KneeRoofline
from sim.engine import Engine, EngineConfig, RequestTooLong, Sequence
from sim.workload import TraceRequest

ONE_SECOND_STEPS = KneeRoofline(
    a_s=1.0, b_s_per_token=0.0, n0_tokens=0, c_s_per_seq=0.0, d_s_per_context_token=0.0
)


def _request(name: str, prompt: int, output: int, prefix: tuple[int, ...] = ()) -> TraceRequest:
    return TraceRequest(name, 0.0, prompt, output, prefix)


def _run(engine: Engine, start: float = 0.0) -> float:
    """Step until idle; return the end time."""
    now = start
    while (plan := engine.plan_step(now)) is not None:
        now += plan.duration_s
        engine.finish_step(plan, now)
    return now


def test_a_prompt_is_prefilled_in_chunks_then_decoded_one_token_a_step() -> None:
    engine = Engine(
        EngineConfig(num_blocks=16, block_size=4, max_num_batched_tokens=16), ONE_SECOND_STEPS
    )
    sequence = Sequence(_request("a", prompt=40, output=3), enqueued_s=0.0)
    engine.add(sequence)
    plans = []
    now = 0.0
    while (plan := engine.plan_step(now)) is not None:
        plans.append((plan.prefill_tokens, plan.decode_seqs))
        now += plan.duration_s
        engine.finish_step(plan, now)
    assert plans == [(16, 0), (16, 0), (8, 0), (0, 1), (0, 1)]
    assert sequence.first_token_s == 3.0
    assert sequence.finished_s == 5.0
    assert sequence.generated == 3
    assert engine.pool.used_blocks == 0


def test_a_later_prompt_reuses_the_cached_prefix() -> None:
    engine = Engine(EngineConfig(num_blocks=32, block_size=4), ONE_SECOND_STEPS)
    first = Sequence(_request("a", 16, 1, prefix=(1, 2, 3, 4)), 0.0)
    second = Sequence(_request("b", 18, 1, prefix=(1, 2, 3, 9)), 0.0)
    engine.add(first)
    _run(engine)
    engine.add(second)
    plan = engine.plan_step(0.0)
    assert second.cached_tokens == 12
    assert plan is not None
    assert plan.prefill_tokens == 6
    assert engine.pool.counters.prefix_hits_tokens == 12


def test_decodes_go_first_and_a_new_prompt_takes_what_budget_is_left() -> None:
    engine = Engine(
        EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=10), ONE_SECOND_STEPS
    )
    for name in "ab":
        engine.add(Sequence(_request(name, 4, 5), 0.0))
    plan = engine.plan_step(0.0)
    assert plan is not None
    engine.finish_step(plan, 1.0)
    engine.add(Sequence(_request("c", 20, 2), 1.0))
    plan = engine.plan_step(0.0)
    assert plan is not None
    assert (plan.decode_seqs, plan.prefill_tokens) == (2, 8)


def test_a_request_that_could_never_fit_is_refused() -> None:
    engine = Engine(EngineConfig(num_blocks=4, block_size=4, max_model_len=12), ONE_SECOND_STEPS)
    assert engine.accepts(_request("fits", 8, 4))
    with pytest.raises(RequestTooLong, match="8 prompt \\+ 5 output tokens exceed 12"):
        engine.add(Sequence(_request("long", 8, 5), 0.0))


def test_no_more_than_max_num_seqs_run_at_once() -> None:
    engine = Engine(EngineConfig(num_blocks=64, block_size=4, max_num_seqs=2), ONE_SECOND_STEPS)
    for name in "abc":
        engine.add(Sequence(_request(name, 4, 3), 0.0))
    engine.plan_step(0.0)
    assert len(engine.running) == 2
    assert len(engine.waiting) == 1


def test_when_blocks_run_out_the_newest_sequence_is_preempted_and_recomputed() -> None:
    engine = Engine(EngineConfig(num_blocks=6, block_size=4), ONE_SECOND_STEPS)
    old = Sequence(_request("old", 8, 12), 0.0)
    new = Sequence(_request("new", 8, 12), 0.0)
    engine.add(old)
    engine.add(new)
    _run(engine)
    assert new.preemptions >= 1
    assert old.preemptions == 0
    assert new.recomputed_tokens > 0
    assert engine.counters.preemptions == new.preemptions
    assert (old.generated, new.generated) == (12, 12)
    assert engine.pool.used_blocks == 0


def test_the_prefix_counters_leave_out_a_preempted_sequence_s_lookups_again() -> None:
    # two fresh 100-token prompts (7 blocks each) growing to 11 blocks on 20: one preempted
    engine = Engine(EngineConfig(num_blocks=20, block_size=16), ONE_SECOND_STEPS)
    prompts = [
        Sequence(_request(name, 100, 70, prefix=tuple(range(n * 10, n * 10 + 6))), 0.0)
        for n, name in enumerate("ab")
    ]
    for sequence in prompts:
        engine.add(sequence)
    _run(engine)
    assert engine.counters.preemptions >= 1
    counters = engine.pool.counters
    assert counters.prefix_queries_tokens == sum(s.request.input_tokens for s in prompts)
    assert counters.prefix_hits_tokens == sum(s.cached_tokens for s in prompts)


def test_under_priority_scheduling_the_lowest_priority_is_preempted_not_the_newest() -> None:
    config = EngineConfig(num_blocks=6, block_size=4, scheduling_policy="priority")
    engine = Engine(config, ONE_SECOND_STEPS)
    batch = Sequence(_request("batch", 8, 12), 0.0, priority=2)
    chat = Sequence(_request("chat", 8, 12), 1.0, priority=0)
    engine.add(batch)
    first = engine.plan_step(0.0)
    assert first is not None
    engine.finish_step(first, 1.0)
    engine.add(chat)  # the newest: fcfs would preempt it
    _run(engine, start=1.0)
    assert chat.preemptions == 0
    assert batch.preemptions >= 1
    assert chat.finished_s is not None
    assert batch.finished_s is not None
    assert chat.finished_s < batch.finished_s
    assert engine.pool.used_blocks == 0


def test_a_victim_already_planned_this_step_leaves_the_plan_and_returns_its_budget() -> None:
    config = EngineConfig(
        num_blocks=6, block_size=4, max_num_batched_tokens=64, scheduling_policy="priority"
    )
    engine = Engine(config, ONE_SECOND_STEPS)
    batch = Sequence(_request("batch", 4, 12), 0.0, priority=2)
    chat = Sequence(_request("chat", 8, 12), 0.0, priority=0)
    engine.add(batch)
    first = engine.plan_step(0.0)
    assert first is not None
    now = first.duration_s
    engine.finish_step(first, now)
    engine.add(chat)  # admitted second: planned after batch among the running
    while batch.preemptions == 0:
        plan = engine.plan_step(now)
        assert plan is not None
        now += plan.duration_s
        engine.finish_step(plan, now)
    assert all(sequence is not batch for sequence, _ in plan.scheduled)
    assert engine.waiting.peek() is batch


def test_the_priority_queue_lets_the_most_urgent_start_first() -> None:
    config = EngineConfig(num_blocks=64, block_size=4, max_num_seqs=1, scheduling_policy="priority")
    engine = Engine(config, ONE_SECOND_STEPS)
    early_batch = Sequence(_request("batch", 4, 2), 0.0, priority=2)
    late_chat = Sequence(_request("chat", 4, 2), 1.0, priority=0)
    engine.add(early_batch)
    engine.add(late_chat)
    _run(engine)
    assert late_chat.scheduled_s == 0.0
    assert early_batch.scheduled_s is not None
    assert early_batch.scheduled_s > 0.0


def test_cancelling_frees_blocks_at_once_and_the_step_in_flight_skips_it() -> None:
    engine = Engine(EngineConfig(num_blocks=32, block_size=4), ONE_SECOND_STEPS)
    sequence = Sequence(_request("a", 20, 50), 0.0)
    engine.add(sequence)
    plan = engine.plan_step(0.0)
    assert plan is not None
    assert engine.pool.used_blocks == 5
    engine.cancel(sequence)
    assert engine.pool.used_blocks == 0
    assert engine.finish_step(plan, 1.0) == []
    assert sequence.first_token_s is None
    assert engine.idle


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 60), st.integers(1, 20), st.lists(st.integers(0, 3), max_size=4)),
        min_size=1,
        max_size=12,
    ),
    st.integers(16, 40),
    st.sampled_from(["fcfs", "priority"]),
)
def test_every_workload_drains_with_each_token_generated_once(
    requests: list[tuple[int, int, list[int]]], num_blocks: int, policy: EngineScheduling
) -> None:
    config = EngineConfig(
        num_blocks=num_blocks, block_size=4, max_num_batched_tokens=32, scheduling_policy=policy
    )
    engine = Engine(config, ONE_SECOND_STEPS)
    sequences = []
    for index, (prompt, output, prefix) in enumerate(requests):
        full_blocks = prompt // 4
        hashes = tuple(hash(tuple(prefix[: i + 1])) for i in range(min(len(prefix), full_blocks)))
        request = _request(str(index), prompt, output, hashes)
        if not engine.accepts(request):
            with pytest.raises(RequestTooLong):
                engine.add(Sequence(request, 0.0))
            continue
        sequences.append(Sequence(request, 0.0, priority=index % 3))
        engine.add(sequences[-1])
    _run(engine)
    for sequence in sequences:
        assert sequence.generated == sequence.request.output_tokens
        assert sequence.first_token_s is not None
        assert sequence.finished_s is not None
        assert sequence.first_token_s <= sequence.finished_s
    assert engine.pool.used_blocks == 0


def test_a_preempted_sequence_has_lost_what_it_computed_not_the_prefix_it_found_cached() -> None:
    engine = Engine(EngineConfig(num_blocks=32, block_size=4), ONE_SECOND_STEPS)
    engine.add(Sequence(_request("a", 16, 1, prefix=(1, 2, 3, 4)), 0.0))
    _run(engine)
    sequence = Sequence(_request("b", 18, 4, prefix=(1, 2, 3, 9)), 0.0)
    engine.add(sequence)
    plan = engine.plan_step(0.0)
    assert plan is not None
    engine.finish_step(plan, 1.0)
    assert (sequence.cached_tokens, sequence.computed) == (12, 18)
    engine._preempt(sequence)  # as when blocks run out: the newest running sequence goes
    assert sequence.recomputed_tokens == 6  # its uncached prompt, to prefill again
