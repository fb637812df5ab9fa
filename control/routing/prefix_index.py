"""An approximate index of which instance holds which prompt prefix, learned from routing.

After each decision the router records the request's block hashes as cached on the
instance it chose. Each instance's entries live in an LRU sized like its KV cache (in
blocks), so the index forgets roughly when the engine would; where an engine publishes KV
events, its evictions correct the guess (``evicted``, ``cleared``).

Semantics follow the Gateway API inference extension's prefix-cache scorer, which llm-d's
default profile uses (``pkg/epp/scheduling/framework/plugins/prefixcachescorer/indexer.go``
and ``plugin.go``): the match is greedy from the first block, and every instance holding
block ``i`` gains one while any instance holds it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence

import numpy as np
import numpy.typing as npt


class ApproximatePrefixIndex:
    """``stride`` > 1 keeps only every ``stride``-th block (the last of each group): since
    block hashes chain, one block still identifies the whole prefix before it, so matching
    costs ``stride`` times less at ``stride`` blocks of granularity.

    A block's holders are a bitmask, bit ``i`` for instance ``i``: a plain int, which the
    garbage collector never scans (a set per block made its pauses the tail of a routing
    decision), and which compares whole in one step.
    """

    def __init__(self, default_capacity: int = 31_250, stride: int = 1) -> None:
        self.default_capacity = default_capacity
        self.stride = stride
        self._lru: dict[int, Recency] = {}
        self._capacity: dict[int, int] = {}
        self._holders: dict[int, int] = {}

    def match(self, hashes: Sequence[int], instances: int) -> npt.NDArray[np.int64]:
        """Matched leading blocks per instance (greedy, as the extension's scorer does:
        while any instance holds block ``k``, each that does gains one).

        Counted in runs of blocks with the same holders, so a block costs one comparison
        and each change of holders one vector update.
        """
        matched = np.zeros(instances, dtype=np.int64)
        holders_of = self._holders.get
        sampled = hashes[self.stride - 1 :: self.stride]
        run, run_start, position = 0, 0, len(sampled)
        for at, block in enumerate(sampled):
            holders = holders_of(block)
            if holders is None:
                position = at
                break
            if holders != run:
                matched += (at - run_start) * _members(run, instances)
                run, run_start = holders, at
        matched += (position - run_start) * _members(run, instances)
        return matched * self.stride

    def add(self, instance: int, hashes: Sequence[int], capacity: int | None = None) -> None:
        """Record ``hashes`` as cached on ``instance``; its LRU is sized on first use."""
        lru = self._lru.get(instance)
        if lru is None:
            lru = self._lru[instance] = Recency()
            self._capacity[instance] = (
                capacity if capacity and capacity > 0 else (self.default_capacity)
            )
        bit = 1 << instance
        holders = self._holders
        for block in lru.touch(hashes[self.stride - 1 :: self.stride]):
            holders[block] = holders.get(block, 0) | bit
        for block in lru.evict_beyond(self._capacity[instance] // self.stride):
            self._forget(block, bit)

    def evicted(self, instance: int, hashes: Sequence[int]) -> None:
        """The engine reports these blocks gone from ``instance`` (a KV event); hashes the
        index never sampled are ignored."""
        entries = self._lru.get(instance)
        if entries is None:
            return
        bit = 1 << instance
        for block in hashes:
            if entries.discard(block):
                self._forget(block, bit)

    def remove_instance(self, instance: int) -> None:
        """Forget everything of ``instance`` (it left, or its engine cleared its cache)."""
        bit = 1 << instance
        entries = self._lru.pop(instance, None)
        for block in entries.blocks() if entries else ():
            self._forget(block, bit)
        self._capacity.pop(instance, None)

    def _forget(self, block: int, bit: int) -> None:
        """Drop the instance whose bit is ``bit`` from the holders of ``block``."""
        holders = self._holders.get(block, 0) & ~bit
        if holders:
            self._holders[block] = holders
        else:
            self._holders.pop(block, None)


class Recency:
    """One instance's blocks in least-recently-used order, without the pauses of an
    ``OrderedDict``.

    An ``OrderedDict`` that keeps taking and dropping keys rebuilds its order table now
    and then, in a time that grows with its size: about a millisecond at a few thousand
    blocks, the tail of a routing decision. Here each block keeps the tick of its last use,
    and a queue lists (block, tick) in order of use; an entry whose tick is no longer its
    block's is stale, skipped when it comes out. The queue is compacted when stale entries
    outnumber live ones (rarely, on an instance that reuses blocks and seldom evicts).
    Evictions come out in exactly an ``OrderedDict``'s order.
    """

    __slots__ = ("_blocks", "_clock", "_slack", "_tick_of", "_ticks")

    def __init__(self, slack: int = 1024) -> None:
        self._slack = slack
        """Stale queue entries always tolerated, so a small LRU is not compacted every call."""
        self._tick_of: dict[int, int] = {}
        self._blocks: deque[int] = deque()
        self._ticks: deque[int] = deque()
        self._clock = 0

    def touch(self, blocks: Sequence[int]) -> list[int]:
        """Mark ``blocks`` used now, in order; returns those that were not held."""
        tick_of, queued, ticks = self._tick_of, self._blocks, self._ticks
        clock, new = self._clock, []
        for block in blocks:
            clock += 1
            if block not in tick_of:
                new.append(block)
            tick_of[block] = clock
            queued.append(block)
            ticks.append(clock)
        self._clock = clock
        if len(queued) > 2 * len(tick_of) + self._slack:
            self._compact()
        return new

    def evict_beyond(self, limit: int) -> Iterator[int]:
        """Drop the least recently used blocks until at most ``limit`` remain, yielding each."""
        tick_of, queued, ticks = self._tick_of, self._blocks, self._ticks
        while len(tick_of) > limit:
            block, tick = queued.popleft(), ticks.popleft()
            if tick_of.get(block) == tick:
                del tick_of[block]
                yield block

    def discard(self, block: int) -> bool:
        """Forget ``block`` (its queue entry goes stale); True if it was held."""
        return self._tick_of.pop(block, None) is not None

    def blocks(self) -> list[int]:
        return list(self._tick_of)

    def _compact(self) -> None:
        live = sorted(self._tick_of.items(), key=lambda entry: entry[1])
        self._blocks = deque(block for block, _ in live)
        self._ticks = deque(tick for _, tick in live)


def _members(holders: int, instances: int) -> npt.NDArray[np.int64]:
    """Bitmask ``holders`` as 0/1 per instance, for the first ``instances``."""
    if not holders:
        return np.zeros(instances, dtype=np.int64)
    raw = holders.to_bytes((max(holders.bit_length(), instances) + 7) // 8, "little")
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), count=instances, bitorder="little")
    return bits.astype(np.int64)
