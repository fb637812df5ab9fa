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
    costs ``stride`` times less at ``stride`` blocks of granularity."""

    def __init__(self, default_capacity: int = 31_250, stride: int = 1) -> None:
        self.default_capacity = default_capacity
        self.stride = stride
        self._lru: dict[int, OrderedDict[int, None]] = {}
        self._capacity: dict[int, int] = {}
        self._holders: dict[int, set[int]] = {}
        self._print: dict[int, int] = {}
        """Per block, the XOR of its holders' keys: equal sets have equal prints, so a
        match compares sets only where the print changes (two different sets sharing a
        print is a 64-bit coincidence)."""

    def match(self, hashes: Sequence[int], instances: int) -> npt.NDArray[np.int64]:
        """Matched leading blocks per instance (greedy, as the extension's scorer does:
        while any instance holds block ``k``, each that does gains one).

        Counted in runs: an instance's credit accrues from when it joins the holders of
        consecutive blocks until it leaves them, so each block costs only the change.
        """
        started: dict[int, int] = {}
        credit: dict[int, int] = {}
        previous: set[int] = set()
        previous_print = 0
        print_of, holders_of = self._print.get, self._holders.__getitem__
        sampled = hashes[self.stride - 1 :: self.stride]
        position = len(sampled)
        for position, block in enumerate(sampled):
            block_print = print_of(block)
            if block_print is None:
                break
            if block_print != previous_print:
                holders = holders_of(block)
                for instance in previous - holders:
                    credit[instance] = credit.get(instance, 0) + position - started.pop(instance)
                for instance in holders - previous:
                    started[instance] = position
                previous, previous_print = holders, block_print
        else:
            position = len(sampled)
        for instance, start in started.items():
            credit[instance] = credit.get(instance, 0) + position - start
        matched = np.zeros(instances, dtype=np.int64)
        if credit:
            matched[list(credit)] = np.fromiter(credit.values(), np.int64, len(credit))
            matched *= self.stride
        return matched

    def add(self, instance: int, hashes: Sequence[int], capacity: int | None = None) -> None:
        """Record ``hashes`` as cached on ``instance``; its LRU is sized on first use."""
        lru = self._lru.get(instance)
        if lru is None:
            lru = self._lru[instance] = OrderedDict()
            self._capacity[instance] = (
                capacity if capacity and capacity > 0 else (self.default_capacity)
            )
        limit = self._capacity[instance] // self.stride
        key = _instance_key(instance)
        seen, touch = lru.__contains__, lru.move_to_end
        holders, prints = self._holders, self._print
        for block in hashes[self.stride - 1 :: self.stride]:
            if seen(block):
                touch(block)
                continue
            lru[block] = None
            held_by = holders.get(block)
            if held_by is None:
                holders[block] = {instance}
                prints[block] = key
            else:
                held_by.add(instance)
                prints[block] ^= key
        while len(lru) > limit:
            evicted, _ = lru.popitem(last=False)
            self._forget(evicted, instance, key)

    def evicted(self, instance: int, hashes: Sequence[int]) -> None:
        """The engine reports these blocks gone from ``instance`` (a KV event); hashes the
        index never sampled are ignored."""
        entries = self._lru.get(instance)
        if entries is None:
            return
        key = _instance_key(instance)
        for block in hashes:
            if block in entries:
                del entries[block]
                self._forget(block, instance, key)

    def remove_instance(self, instance: int) -> None:
        """Forget everything of ``instance`` (it left, or its engine cleared its cache)."""
        key = _instance_key(instance)
        for block in self._lru.pop(instance, {}):
            self._forget(block, instance, key)
        self._capacity.pop(instance, None)

    def _forget(self, block: int, instance: int, key: int) -> None:
        """Drop ``instance`` (whose key is ``key``) from the holders of ``block``."""
        holders = self._holders.get(block)
        if holders is None or instance not in holders:
            return
        holders.remove(instance)
        self._print[block] ^= key
        if not holders:
            del self._holders[block]
            del self._print[block]


_MASK = (1 << 64) - 1


def _instance_key(instance: int) -> int:
    """A fixed pseudo-random 64-bit key per instance (splitmix64's finaliser), so that
    prints are the same in every run."""
    z = (instance + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)
