"""DC-level cache locality: where an edge sent each prompt's prefix last. A prefix warm
in one DC's engines is cold in the others, and an edge knows which DC it sent a prompt
to; the policies read it as the tokens of a request's prompt warm in each DC
(``DataCenterState.warm_tokens``).

Prefixes are kept by their sampled blocks, as TokenPilot's index keeps them
(``INDEX_STRIDE``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from control.routing.prefix_index import sampled_blocks
from control.routing.tokenpilot import INDEX_STRIDE
from control.tokens import BLOCK_TOKENS


class PrefixLocality:
    """The DC each sampled prefix block went to last, the most recent ``capacity`` blocks
    (None: every block, as the simulator's edge keeps them over a run)."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self._last_dc: OrderedDict[int, str] = OrderedDict()

    def sent(self, prefix_blocks: Sequence[int], dc: str) -> None:
        """A prompt with these prefix blocks went to ``dc``."""
        for block in sampled_blocks(prefix_blocks, INDEX_STRIDE):
            self._last_dc[block] = dc
            self._last_dc.move_to_end(block)
        while self.capacity is not None and len(self._last_dc) > self.capacity:
            self._last_dc.popitem(last=False)

    def warm_tokens(self, prefix_blocks: Sequence[int]) -> dict[str, int]:
        """Per DC, the deepest sampled block of this prompt that last went there, in
        tokens."""
        warm: dict[str, int] = {}
        sampled = sampled_blocks(prefix_blocks, INDEX_STRIDE)
        for depth, block in enumerate(sampled, start=1):
            if (dc := self._last_dc.get(block)) is not None:
                warm[dc] = depth * INDEX_STRIDE * BLOCK_TOKENS
        return warm
