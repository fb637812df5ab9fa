"""Loaders of the public traces in ``../shared/traces`` (see its README for sources)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from sim.workload import ENGINE_BLOCK_TOKENS, TraceRequest

MOONCAKE_BLOCK_TOKENS = 512
MOONCAKE_BUCKET_S = 3.0
_MASK64 = (1 << 64) - 1


def traces_dir() -> Path:
    """``$TOKENFLEET_TRACES``, else the ``shared/traces`` folder beside the repository."""
    configured = os.environ.get("TOKENFLEET_TRACES")
    if configured:
        return Path(configured)
    return Path(__file__).resolve().parents[2] / "shared" / "traces"


def load_mooncake(
    path: Path | None = None, *, limit: int | None = None, seed: int = 0
) -> list[TraceRequest]:
    """The Mooncake FAST'25 conversation trace (Qin et al., USENIX FAST 2025).

    Its timestamps come in 3 s buckets; each request is placed uniformly at random (seeded)
    inside its bucket so arrivals are smooth. Each 512-token ``hash_id`` becomes 32 engine
    blocks of 16 tokens with derived hashes; only full engine blocks get one.
    """
    path = path or traces_dir() / "mooncake_fast25" / "conversation_trace.jsonl"
    rng = random.Random(seed)
    requests = []
    with path.open() as lines:
        for index, line in enumerate(lines):
            if limit is not None and index >= limit:
                break
            row = json.loads(line)
            arrival = row["timestamp"] / 1000.0 + rng.uniform(0.0, MOONCAKE_BUCKET_S)
            requests.append(
                TraceRequest(
                    request_id=f"mooncake-{index}",
                    arrival_s=arrival,
                    input_tokens=row["input_length"],
                    output_tokens=row["output_length"],
                    prefix_blocks=engine_blocks(row["hash_ids"], row["input_length"]),
                )
            )
    requests.sort(key=lambda r: r.arrival_s)
    return requests


def engine_blocks(hash_ids: list[int], input_tokens: int) -> tuple[int, ...]:
    """Map 512-token trace blocks onto the hashes of the 16-token engine blocks they hold."""
    per_block = MOONCAKE_BLOCK_TOKENS // ENGINE_BLOCK_TOKENS
    full_engine_blocks = input_tokens // ENGINE_BLOCK_TOKENS
    hashes = []
    for position in range(full_engine_blocks):
        trace_id = hash_ids[position // per_block]
        hashes.append(_mix(trace_id * per_block + position % per_block))
    return tuple(hashes)


def _mix(value: int) -> int:
    """SplitMix64 finaliser, folded to a non-negative 63-bit integer."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1
