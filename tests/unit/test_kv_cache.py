from __future__ import annotations

import contextlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sim.kv_cache import KvBlockPool, OutOfBlocks


def _compute_prompt(pool: KvBlockPool, hashes: list[int], tokens: int) -> list[int]:
    """What an engine does for a prompt: reuse the cached prefix, allocate and register
    the rest."""
    reusable = pool.usable_prefix(hashes, tokens)
    needed = -(-tokens // pool.block_size) - reusable
    blocks, _ = pool.start_prompt(hashes, tokens, needed)
    for block, block_hash in zip(blocks, hashes, strict=False):
        pool.register(block, block_hash)
    return blocks


def test_a_second_prompt_reuses_the_shared_prefix_and_counts_the_hit() -> None:
    pool = KvBlockPool(num_blocks=10, block_size=4)
    first = _compute_prompt(pool, [1, 2, 3], tokens=12)
    assert pool.counters.prefix_hits_tokens == 0
    second = _compute_prompt(pool, [1, 2, 9], tokens=14)
    assert second[:2] == first[:2]
    assert pool.counters.prefix_hits_tokens == 8
    assert pool.counters.prefix_queries_tokens == 26
    assert pool.used_blocks == 3 + 2  # shared two, second added one full and one partial


def test_the_last_prompt_token_is_always_computed() -> None:
    pool = KvBlockPool(num_blocks=10, block_size=4)
    blocks = _compute_prompt(pool, [1, 2], tokens=8)
    pool.release(blocks)
    blocks, cached_tokens = pool.start_prompt([1, 2], prompt_tokens=8, new_blocks=1)
    assert cached_tokens == 4
    assert len(blocks) == 2


def test_freed_blocks_stay_cached_until_handed_out_again() -> None:
    pool = KvBlockPool(num_blocks=4, block_size=4)
    blocks = _compute_prompt(pool, [1, 2], tokens=8)
    pool.release(blocks)
    assert pool.free_blocks == 4
    assert pool.cached_prefix([1, 2]) == 2
    pool.allocate(2)  # the two never-used blocks go first
    assert pool.cached_prefix([1, 2]) == 2
    assert pool.counters.evicted_blocks == 0
    pool.allocate(1)  # then the prompt's tail is evicted before its head
    assert pool.cached_prefix([1, 2]) == 1
    assert pool.counters.evicted_blocks == 1


def test_a_pool_built_with_kv_events_logs_what_it_stores_and_evicts_in_order() -> None:
    pool = KvBlockPool(num_blocks=2, block_size=4, kv_events=True)
    pool.release(_compute_prompt(pool, [1, 2], tokens=8))
    assert pool.take_events() == [(1, True), (2, True)]
    assert pool.take_events() == []  # each event is taken once
    _compute_prompt(pool, [3], tokens=4)  # evicts the tail of [1, 2] first
    assert pool.take_events() == [(2, False), (3, True)]
    silent = KvBlockPool(num_blocks=2, block_size=4)
    silent.release(_compute_prompt(silent, [1, 2], tokens=8))
    assert silent.take_events() == []


def test_a_referenced_block_is_never_evicted() -> None:
    pool = KvBlockPool(num_blocks=3, block_size=4)
    held = _compute_prompt(pool, [1], tokens=4)
    with pytest.raises(OutOfBlocks, match="need 3 blocks, 2 free"):
        pool.allocate(3)
    assert pool.free_blocks == 2
    pool.allocate(2)
    assert pool.cached_prefix([1]) == 1
    pool.release(held)


def test_two_prompts_computing_one_prefix_keep_the_first_copy() -> None:
    pool = KvBlockPool(num_blocks=4, block_size=4)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.register(a[0], 7)
    pool.register(b[0], 7)
    pool.release(a + b)
    assert pool.start_prompt([7], prompt_tokens=5, new_blocks=0) == (a, 4)


def test_a_prompt_that_does_not_fit_changes_nothing() -> None:
    pool = KvBlockPool(num_blocks=3, block_size=4)
    pool.release(_compute_prompt(pool, [1, 2], tokens=8))
    # The cached prefix is itself free: reusing it leaves only one block to allocate from.
    with pytest.raises(OutOfBlocks, match="need 2 blocks, 1 free"):
        pool.start_prompt([1, 2, 3], prompt_tokens=16, new_blocks=2)
    assert pool.free_blocks == 3
    assert pool.counters.prefix_queries_tokens == 8


def test_releasing_too_often_is_a_bug_that_is_caught() -> None:
    pool = KvBlockPool(num_blocks=2)
    blocks = pool.allocate(1)
    pool.release(blocks)
    with pytest.raises(AssertionError, match="released more often"):
        pool.release(blocks)


class PoolMachine(RuleBasedStateMachine):
    """Random prompts come and go; the pool's books must always balance."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = KvBlockPool(num_blocks=12, block_size=2)
        self.held: list[list[int]] = []

    @rule(prefix=st.lists(st.integers(0, 5), min_size=1, max_size=5), extra=st.integers(0, 3))
    def compute(self, prefix: list[int], extra: int) -> None:
        hashes = [hash(tuple(prefix[: i + 1])) for i in range(len(prefix))]  # chained
        with contextlib.suppress(OutOfBlocks):
            self.held.append(_compute_prompt(self.pool, hashes, 2 * len(hashes) + extra))

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 100))
    def finish(self, index: int) -> None:
        self.pool.release(self.held.pop(index % len(self.held)))

    @invariant()
    def books_balance(self) -> None:
        referenced = {b for blocks in self.held for b in blocks}
        assert self.pool.used_blocks == len(referenced)
        refs = [sum(b == block for blocks in self.held for b in blocks) for block in range(12)]
        assert refs == self.pool._refs
        for block_hash, block in self.pool._block_of.items():
            assert self.pool._hash_of[block] == block_hash


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
