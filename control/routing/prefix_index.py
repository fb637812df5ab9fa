"""An approximate index of which instance holds which prompt prefix, learned from routing.

After each decision the router records the request's block hashes as cached on the
instance it chose. Each instance's entries live in an LRU sized like its KV cache (its
tokens, in the index's 16-token blocks), so the index forgets roughly when the engine
would; where an engine publishes KV events, its evictions correct the guess (``evicted``,
``cleared``).

Semantics follow the Gateway API inference extension's prefix-cache scorer, which llm-d's
default profile uses (``pkg/epp/scheduling/framework/plugins/prefixcachescorer/indexer.go``
and ``plugin.go``): the match is greedy from the first block, and every instance holding
block ``i`` gains one while any instance holds it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import compress, islice, repeat
from operator import not_

import numpy as np
import numpy.typing as npt


def sampled_blocks(hashes: Sequence[int], stride: int) -> Sequence[int]:
    """Every ``stride``-th block hash, the last of each group of ``stride``: hashes chain,
    so each stands for the whole prefix before it."""
    return hashes[stride - 1 :: stride]


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
        sampled = sampled_blocks(hashes, self.stride)
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
        """Record ``hashes`` as cached on ``instance``, whose LRU holds ``capacity`` blocks:
        the latest given (an engine's size may be learned only after its first request),
        else ``default_capacity``."""
        lru = self._lru.get(instance)
        if lru is None:
            lru = self._lru[instance] = Recency()
            self._capacity[instance] = self.default_capacity
        if capacity and capacity > 0:
            self._capacity[instance] = capacity
        bit = 1 << instance
        holders = self._holders
        new = lru.touch(sampled_blocks(hashes, self.stride))
        holders.update(zip(new, map(bit.__or__, map(holders.get, new, repeat(0))), strict=True))
        self._leave(lru.evict_beyond(self._capacity[instance] // self.stride), bit)

    def sizes(self, instances: int) -> npt.NDArray[np.int64]:
        """Entries each of the first ``instances`` holds."""
        return np.array([len(self._lru.get(i, ())) for i in range(instances)], dtype=np.int64)

    def evicted(self, instance: int, hashes: Sequence[int]) -> None:
        """The engine reports these blocks gone from ``instance`` (a KV event); hashes the
        index never sampled are ignored."""
        entries = self._lru.get(instance)
        if entries is None:
            return
        self._leave([block for block in hashes if entries.discard(block)], 1 << instance)

    def remove_instance(self, instance: int) -> None:
        """Forget everything of ``instance`` (it left, or its engine cleared its cache)."""
        entries = self._lru.pop(instance, None)
        self._leave(entries.blocks() if entries else [], 1 << instance)
        self._capacity.pop(instance, None)

    def _leave(self, blocks: list[int], bit: int) -> None:
        """Drop the instance whose bit is ``bit`` from the holders of ``blocks``; a block
        that no instance holds any more leaves the index. In passes of C (``map``), not a
        Python loop: evictions come in hundreds per routed prompt."""
        holders = self._holders
        left = list(map((~bit).__and__, map(holders.get, blocks, repeat(0))))
        holders.update(compress(zip(blocks, left, strict=True), left))
        deque(map(holders.pop, compress(blocks, map(not_, left))), maxlen=0)


class Recency:
    """One instance's blocks in least-recently-used order: a plain dict, whose keys keep
    the order they were put in; a block used again is taken out and put back at the end.

    Not an ``OrderedDict``: one that keeps taking and dropping keys rebuilds its order
    table now and then, in a time that grows with its size (about a millisecond at a few
    thousand blocks, the tail of a routing decision). A plain dict's taken keys leave
    holes, which reading from the front skips and its next resize drops. Each call works
    in passes of C (``map``, ``update``, ``islice``): on a full cache a 16k-token prompt
    evicts as many blocks as it brings, and evicting them one by one in Python took a
    fifth of TokenPilot's decision time (``tokenfleet bench decision``).
    """

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: dict[int, bool] = {}

    def touch(self, blocks: Sequence[int]) -> list[int]:
        """Mark ``blocks`` used now, in order; returns those that were not held (each
        once, in no promised order)."""
        if len(set(blocks)) < len(blocks):  # a block used twice counts from its last use
            blocks = list(dict.fromkeys(reversed(blocks)))[::-1]
        held = self._held
        was_held = list(map(held.pop, blocks, repeat(False)))
        held.update(zip(blocks, repeat(True)))
        return list(compress(blocks, map(not_, was_held)))

    def evict_beyond(self, limit: int) -> list[int]:
        """Drop the least recently used blocks until at most ``limit`` remain; returns them."""
        dropped = list(islice(self._held, max(len(self._held) - limit, 0)))
        deque(map(self._held.pop, dropped), maxlen=0)
        return dropped

    def discard(self, block: int) -> bool:
        """Forget ``block``; True if it was held."""
        return self._held.pop(block, False)

    def blocks(self) -> list[int]:
        return list(self._held)

    def __len__(self) -> int:
        return len(self._held)


def _members(holders: int, instances: int) -> npt.NDArray[np.int64]:
    """Bitmask ``holders`` as 0/1 per instance, for the first ``instances``."""
    if not holders:
        return np.zeros(instances, dtype=np.int64)
    raw = holders.to_bytes((max(holders.bit_length(), instances) + 7) // 8, "little")
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), count=instances, bitorder="little")
    return bits.astype(np.int64)
