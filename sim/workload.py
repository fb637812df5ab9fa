"""Workload requests as the simulator and the replayers see them."""

from __future__ import annotations

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
    prefix_blocks: tuple[int, ...]
    """Chained hashes of the prompt's full engine blocks: equal hashes at equal positions
    mean an equal prompt up to the end of that block."""
    task_class: TaskClass = TaskClass.INTERACTIVE
    tenant: str = "default"
    region: str = "local"
    deadline_s: float | None = None
    """Seconds after arrival by which a batch request must finish."""


def leading_prefix_hits(prefixes: list[tuple[int, ...]]) -> tuple[int, int]:
    """(hit blocks, all blocks) for prompts in this order against an unbounded prefix cache:
    the best any cache-aware router could reuse."""
    seen: set[int] = set()
    hits = total = 0
    for blocks in prefixes:
        total += len(blocks)
        for block in blocks:
            if block not in seen:
                break
            hits += 1
        seen.update(blocks)
    return hits, total
