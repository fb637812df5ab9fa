"""A paged KV cache with automatic prefix caching, modelled on vLLM v1's block pool.

- The cache has ``num_blocks`` blocks of ``block_size`` tokens.
- A full prompt block is registered under its chained hash once it is computed; a later
  prompt whose leading hashes match reuses those blocks instead of recomputing them.
- Blocks carry reference counts. A block nobody references is *free* but keeps its cached
  content until it is handed out again: free blocks are reused least recently freed first,
  and reusing a cached one evicts its hash.
- A sequence's blocks are freed tail first, so the end of a prompt is evicted before its
  start, which other prompts are likelier to share.

The pool itself is unaware of sequences: callers hold the list of block ids they own.
Built with ``kv_events``, it also logs what vLLM publishes with ``--kv-events-config``:
each hash it stores (BlockStored) and each it evicts (BlockRemoved), in order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from control.routing import KvEvent


class OutOfBlocks(Exception):
    """Not enough free blocks; nothing was allocated."""


@dataclass
class KvCounters:
    """Monotonic counters, as an engine exports them."""

    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    evicted_blocks: int = 0


class KvBlockPool:
    def __init__(self, num_blocks: int, block_size: int = 16, *, kv_events: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.counters = KvCounters()
        self._refs = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._block_of: dict[int, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._events: list[KvEvent] | None = [] if kv_events else None

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def take_events(self) -> list[KvEvent]:
        """The KV events logged since the last call, oldest first; none unless the pool was
        built with ``kv_events``."""
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    def cached_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` are cached now; changes nothing."""
        for count, block_hash in enumerate(hashes):
            if block_hash not in self._block_of:
                return count
        return len(hashes)

    def usable_prefix(self, hashes: Sequence[int], prompt_tokens: int) -> int:
        """Cached leading blocks a new prompt may reuse now: at most all but the block of
        its last token, which the engine must compute to produce the first output token."""
        return min(self.cached_prefix(hashes), (prompt_tokens - 1) // self.block_size)

    def start_prompt(
        self, hashes: Sequence[int], prompt_tokens: int, new_blocks: int, *, resumed: bool = False
    ) -> tuple[list[int], int]:
        """Reuse a new prompt's cached leading blocks and allocate ``new_blocks`` more, all
        or nothing (OutOfBlocks leaves the pool as it was). Returns the blocks, prefix
        first, and how many tokens the prefix covers (see ``usable_prefix``).

        ``resumed``: a sequence starting again after a preemption, whose lookup the prefix
        counters leave out, as vLLM 0.34 counts it apart in stats it does not export
        (``record_prefix_cache_stats`` in vllm/v1/core/kv_cache_manager.py,
        ``PrefixCacheStats.record`` in vllm/v1/metrics/stats.py): else a preemption storm
        reads as prefix hits.
        """
        usable = self.usable_prefix(hashes, prompt_tokens)
        prefix = [self._block_of[h] for h in hashes[:usable]]
        idle_prefix = sum(1 for block in prefix if self._refs[block] == 0)
        if new_blocks > len(self._free) - idle_prefix:
            raise OutOfBlocks(f"need {new_blocks} blocks, {len(self._free) - idle_prefix} free")
        for block in prefix:
            self._reference(block)
        if not resumed:
            self.counters.prefix_queries_tokens += prompt_tokens
            self.counters.prefix_hits_tokens += usable * self.block_size
        return prefix + self.allocate(new_blocks), usable * self.block_size

    def allocate(self, count: int) -> list[int]:
        """``count`` fresh blocks, or OutOfBlocks with nothing taken."""
        if count > len(self._free):
            raise OutOfBlocks(f"need {count} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def register(self, block: int, block_hash: int) -> None:
        """Mark a block, now fully computed, as holding the content ``block_hash`` names.

        If another block already holds that content (two prompts computed the same prefix
        at once), the first stays the cached copy.
        """
        if block_hash not in self._block_of and self._hash_of[block] is None:
            self._block_of[block_hash] = block
            self._hash_of[block] = block_hash
            if self._events is not None:
                self._events.append((block_hash, True))

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block; blocks nobody holds become free, tail first."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
            elif self._refs[block] < 0:
                raise AssertionError(f"block {block} released more often than referenced")

    def _reference(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._free[block]
        self._refs[block] += 1

    def _evict(self, block: int) -> None:
        block_hash = self._hash_of[block]
        if block_hash is not None:
            del self._block_of[block_hash]
            self._hash_of[block] = None
            self.counters.evicted_blocks += 1
            if self._events is not None:
                self._events.append((block_hash, False))
