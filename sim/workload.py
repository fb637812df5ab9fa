"""Workload requests as the simulator and the replayers see them."""

from __future__ import annotations

import hashlib
from collections.abc import Container, Hashable, Sequence
from dataclasses import dataclass

from schemas.base import TaskClass

ENGINE_BLOCK_TOKENS = 16
"""vLLM's default KV block size; prefix hashes are kept per full block of this size."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    request_id: str
    arrival_s: float
    input_tokens: int
    output_tokens: int
    """What the engine generates: known to the simulated engines, never to the routers."""
    prefix_blocks: tuple[int, ...]
    """Chained hashes of the prompt's full engine blocks: equal hashes at equal positions
    mean an equal prompt up to the end of that block."""
    task_class: TaskClass = TaskClass.INTERACTIVE
    tenant: str = "default"
    region: str = "local"
    deadline_s: float | None = None
    """Seconds after arrival by which a batch request must finish."""
    session_id: str | None = None
    round: int = 0
    """Turn within the session, from 0."""
    prefix_group: str | None = None
    """Requests of one group share a leading prompt (a system prompt, say)."""
    prefix_tokens: int = 0
    """Length of that shared leading prompt."""
    max_tokens: int | None = None
    """The cap the client sends (``max_tokens``); None, as in the public traces, which
    record what was generated and not what was asked."""
    residency: tuple[str, ...] = ()
    """The regions the request may run in (empty: any)."""


def reusable_blocks(blocks: Sequence[int], seen: Container[int]) -> int:
    """How many leading ``blocks`` a cache holding ``seen`` already has."""
    for count, block in enumerate(blocks):
        if block not in seen:
            return count
    return len(blocks)


Segment = tuple[Hashable, int]
"""A stretch of prompt: a key naming its content, and its length in tokens."""


def segment_blocks(segments: Sequence[Segment]) -> tuple[int, ...]:
    """Chained hashes of the full 16-token blocks of a prompt made of ``segments``.

    Two prompts get equal hashes for block ``i`` exactly when their segments agree up to
    the end of that block, as an engine's chained block hashes do for equal token ids.
    """
    total = sum(length for _, length in segments)
    hashes: list[int] = []
    parent = 0
    segment, used = 0, 0
    for _ in range(total // ENGINE_BLOCK_TOKENS):
        needed = ENGINE_BLOCK_TOKENS
        parts = []
        while needed:
            key, length = segments[segment]
            take = min(length - used, needed)
            parts.append((key, used, take))
            used += take
            needed -= take
            if used == length:
                segment, used = segment + 1, 0
        digest = hashlib.blake2b(repr((parent, parts)).encode(), digest_size=8).digest()
        parent = int.from_bytes(digest) >> 1
        hashes.append(parent)
    return tuple(hashes)
