"""Replaying a workload against an OpenAI-compatible endpoint, timing it as a client does.

Prompts are text built so that the endpoint's tokeniser rule (``control.tokens``) sees
exactly ``input_tokens`` tokens and the same shared prefixes as the trace: each full block
of the trace becomes 64 bytes derived from its hash, the rest filler unique to the request.
Times are reported in the workload's (virtual) seconds: wall seconds x ``speedup``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from control.tokens import BLOCK_TOKENS, BYTES_PER_TOKEN
from sim.workload import TraceRequest


def prompt_text(request: TraceRequest) -> str:
    blocks = "".join(
        hashlib.blake2b(str(block).encode(), digest_size=32).hexdigest()
        for block in request.prefix_blocks
    )
    filler_tokens = request.input_tokens - len(request.prefix_blocks) * BLOCK_TOKENS
    seed = hashlib.blake2b(request.request_id.encode(), digest_size=16).hexdigest()
    filler = seed * (filler_tokens * BYTES_PER_TOKEN // len(seed) + 1)
    return blocks + filler[: filler_tokens * BYTES_PER_TOKEN]


@dataclass(frozen=True)
class ReplayRecord:
    request_id: str
    status: int
    ttft_s: float | None
    e2e_s: float
    output_tokens: int


async def replay(
    requests: Sequence[TraceRequest],
    base_url: str,
    model: str,
    *,
    speedup: float = 1.0,
    headers: dict[str, str] | None = None,
) -> list[ReplayRecord]:
    """Send each request at its arrival time (streaming /v1/completions); await them all."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=100)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=None, limits=limits, headers=headers
    ) as client:
        start = time.monotonic()
        first = requests[0].arrival_s if requests else 0.0
        tasks = [
            asyncio.create_task(
                _one(client, r, model, start + (r.arrival_s - first) / speedup, speedup)
            )
            for r in requests
        ]
        return list(await asyncio.gather(*tasks))


async def _one(
    client: httpx.AsyncClient, request: TraceRequest, model: str, at: float, speedup: float
) -> ReplayRecord:
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    sent = time.monotonic()
    body = {
        "model": model,
        "prompt": prompt_text(request),
        "max_tokens": request.output_tokens,
        "stream": True,
    }
    first_token: float | None = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return ReplayRecord(
                request.request_id,
                response.status_code,
                None,
                (time.monotonic() - sent) * speedup,
                0,
            )
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text = json.loads(line[6:])["choices"][0]["text"]
            if text and first_token is None:
                first_token = time.monotonic()
            tokens += text.count("tok")
    ttft = None if first_token is None else (first_token - sent) * speedup
    return ReplayRecord(request.request_id, 200, ttft, (time.monotonic() - sent) * speedup, tokens)
