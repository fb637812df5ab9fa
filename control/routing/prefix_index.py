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

from collections import OrderedDict
from collections.abc import Sequence

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
        self._lru: dict[int, OrderedDict[int, None]] = {}
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
            lru = self._lru[instance] = OrderedDict()
            self._capacity[instance] = (
                capacity if capacity and capacity > 0 else (self.default_capacity)
            )
        limit = self._capacity[instance] // self.stride
        bit = 1 << instance
        seen, touch = lru.__contains__, lru.move_to_end
        holders = self._holders
        for block in hashes[self.stride - 1 :: self.stride]:
            if seen(block):
                touch(block)
                continue
            lru[block] = None
            holders[block] = holders.get(block, 0) | bit
        while len(lru) > limit:
            evicted, _ = lru.popitem(last=False)
            self._forget(evicted, bit)

    def evicted(self, instance: int, hashes: Sequence[int]) -> None:
        """The engine reports these blocks gone from ``instance`` (a KV event); hashes the
        index never sampled are ignored."""
        entries = self._lru.get(instance)
        if entries is None:
            return
        bit = 1 << instance
        for block in hashes:
            if block in entries:
                del entries[block]
                self._forget(block, bit)

    def remove_instance(self, instance: int) -> None:
        """Forget everything of ``instance`` (it left, or its engine cleared its cache)."""
        bit = 1 << instance
        for block in self._lru.pop(instance, {}):
            self._forget(block, bit)
        self._capacity.pop(instance, None)

    def _forget(self, block: int, bit: int) -> None:
        """Drop the instance whose bit is ``bit`` from the holders of ``block``."""
        holders = self._holders.get(block, 0) & ~bit
        if holders:
            self._holders[block] = holders
        else:
            self._holders.pop(block, None)


def _members(holders: int, instances: int) -> npt.NDArray[np.int64]:
    """Bitmask ``holders`` as 0/1 per instance, for the first ``instances``."""
    if not holders:
        return np.zeros(instances, dtype=np.int64)
    raw = holders.to_bytes((max(holders.bit_length(), instances) + 7) // 8, "little")
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), count=instances, bitorder="little")
    return bits.astype(np.int64)
