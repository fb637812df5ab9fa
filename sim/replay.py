"""Replaying a workload against an OpenAI-compatible endpoint, timing it as a client does.

Prompts are text built so that the endpoint's tokeniser rule (``control.tokens``) sees
exactly ``input_tokens`` tokens and the same shared prefixes as the trace: each full block
of the trace becomes 64 bytes derived from its hash, the rest filler unique to the request.
Times are reported in the workload's (virtual) seconds: wall seconds x ``speedup``.

Each request carries its class (``x-tokenfleet-class``) and, for batch work, its
deadline (``x-tokenfleet-deadline-s``, in the target's seconds). With a client model
(``sim.clients``) the replay behaves as the simulator's clients do: a client whose first
token has not come within its patience closes its stream, a batch client gives up at its
deadline, and a share of those refused (429, 503), failed or given up try once more,
after the ``Retry-After`` they were told (seconds or an HTTP date) or the model's delay. A
request that fails (an error status, an error event in its stream, a stream event it cannot
read, a connection lost) is recorded as failed, with the reason; the replay goes on.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

from control.tokens import BLOCK_TOKENS, BYTES_PER_TOKEN
from schemas.openai_api import REQUEST_ID_HEADER
from sim.clients import ClientModel
from sim.progress import progress_bar
from sim.workload import TraceRequest

CLASS_HEADER = "x-tokenfleet-class"
DEADLINE_HEADER = "x-tokenfleet-deadline-s"
REFUSALS = frozenset({429, 503})


MAX_PROMPT_TOKENS = 10_000_000
"""The longest prompt a replay sends: ten million tokens (40 MB of text), the longest
context window a public model states (Meta's Llama 4 Scout, 2025). A trace's row of a
billion tokens held the replay building a prompt of gigabytes."""


def _check_sizes(requests: Sequence[TraceRequest]) -> None:
    """ValueError naming the first request whose prompt is past ``MAX_PROMPT_TOKENS``."""
    for request in requests:
        if request.input_tokens > MAX_PROMPT_TOKENS:
            raise ValueError(
                f"request {request.request_id}: a prompt of {request.input_tokens:,} tokens "
                f"is past any model's context ({MAX_PROMPT_TOKENS:,} at most replayed)"
            )


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
    """The HTTP status (0 where the client gave up before any answer)."""
    ttft_s: float | None
    e2e_s: float
    output_tokens: int
    task_class: str = "interactive"
    outcome: str = "completed"
    """``completed``, ``rejected`` (429 or 503), ``cancelled`` (the client gave up) or
    ``failed`` (any other status)."""
    retry_after_s: float | None = None
    """What a refusal's ``Retry-After`` said, in the workload's seconds."""
    gateway_request_id: str | None = None
    """The gateway's id of the request (``x-tokenfleet-request-id``), which its events
    carry; None against a bare instance."""
    error: str | None = None
    """Why a request failed: what went wrong in an answer that came with status 200, or
    the status and message of an error answer that is no refusal (a 404 naming the
    model asked for: the status alone did not say it)."""


@dataclass(frozen=True)
class _Clock:
    """Maps the workload's (virtual) seconds to this process's monotonic clock."""

    start: float
    first: float
    speedup: float

    def wall(self, virtual_s: float) -> float:
        return self.start + (virtual_s - self.first) / self.speedup

    def virtual(self, wall_s: float) -> float:
        return self.first + (wall_s - self.start) * self.speedup


async def replay(
    requests: Sequence[TraceRequest],
    base_url: str,
    model: str,
    *,
    speedup: float = 1.0,
    headers: dict[str, str] | None = None,
    clients: ClientModel | None = None,
    finished: list[ReplayRecord] | None = None,
    progress: bool = False,
) -> list[ReplayRecord]:
    """Send each request at its arrival time (streaming /v1/completions) and await them
    all; ``clients`` None: clients that wait for every answer and never retry. Records
    come in arrival order, a second attempt after its first. Each is also appended to
    ``finished`` as its attempt ends, so a replay cut short (Ctrl-C) keeps those.
    ``progress``: a bar of the requests ended, and how many of them completed (a target
    that fails or refuses every request shows at once, not at the trace's end)."""
    _check_sizes(requests)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=100)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=None, limits=limits, headers=headers
    ) as client:
        first = requests[0].arrival_s if requests else 0.0
        clock = _Clock(time.monotonic(), first, speedup)

        async def attempts(request: TraceRequest) -> list[ReplayRecord]:
            record = await _one(client, request, model, clock, clients)
            if finished is not None:
                finished.append(record)
            if clients is None or record.outcome == "completed":
                return [record]
            again = clients.retry(request, clock.virtual(time.monotonic()), record.retry_after_s)
            return [record] if again is None else [record, *await attempts(again)]

        completed = 0
        with progress_bar(
            total=len(requests), desc="replay", unit="req", leave=False, disable=not progress
        ) as bar:

            async def ended(request: TraceRequest) -> list[ReplayRecord]:
                nonlocal completed
                records = await attempts(request)
                completed += records[-1].outcome == "completed"
                bar.set_postfix(completed=completed, refresh=False)
                bar.update()
                return records

            done = await asyncio.gather(*(ended(r) for r in requests))
        return [record for records in done for record in records]


@dataclass
class _Progress:
    status: int = 0
    first_token: float | None = None
    tokens: int = 0
    error: str | None = None
    """Why the answer failed midway: an error event in the stream (an instance that
    failed mid-answer), an event it could not read, the connection lost."""
    gateway_request_id: str | None = None


async def _one(
    client: httpx.AsyncClient,
    request: TraceRequest,
    model: str,
    clock: _Clock,
    clients: ClientModel | None,
) -> ReplayRecord:
    await asyncio.sleep(max(0.0, clock.wall(request.arrival_s) - time.monotonic()))
    sent = time.monotonic()
    gives_up = None if clients is None else clients.gives_up_at(request)
    seen = _Progress()
    try:
        async with asyncio.timeout_at(None if gives_up is None else clock.wall(gives_up[0])) as by:
            first_token_only = gives_up is not None and gives_up[1]
            refused = await _stream(
                client, request, model, clock, sent, seen, by if first_token_only else None
            )
    except TimeoutError:
        return _record(request, sent, seen, clock, "cancelled")
    except httpx.HTTPError as exc:  # the connection failed: this request, not the replay
        seen.error = f"{type(exc).__name__}: {exc}"
        return _record(request, sent, seen, clock, "failed")
    if refused is not None:
        return refused
    return _record(request, sent, seen, clock, "completed" if seen.error is None else "failed")


async def _stream(
    client: httpx.AsyncClient,
    request: TraceRequest,
    model: str,
    clock: _Clock,
    sent: float,
    seen: _Progress,
    patience: asyncio.Timeout | None,
) -> ReplayRecord | None:
    """Read the answer into ``seen``; the record of a refusal or failure, else None. A
    first token ends ``patience`` (it was all the client waited for)."""
    headers = _headers(request, clock)
    async with client.stream(
        "POST", "/v1/completions", json=_body(request, model), headers=headers
    ) as response:
        seen.status = response.status_code
        seen.gateway_request_id = response.headers.get(REQUEST_ID_HEADER)
        if response.status_code != 200:
            await response.aread()
            return _refused(request, response, sent, clock)
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            try:
                text = _text(line[6:])
            except ValueError as exc:
                seen.error = seen.error or str(exc)
                continue
            if text and seen.first_token is None:
                seen.first_token = time.monotonic()
                if patience is not None:
                    patience.reschedule(None)
            seen.tokens += text.count("tok")
    return None


def _text(data: str) -> str:
    """The text of one stream event; ValueError saying why it has none: an error event, or
    an event that is not a completion chunk. A chunk without choices (the usage chunk
    ``stream_options.include_usage`` adds) has no text."""
    try:
        event: Any = json.loads(data)
    except ValueError:
        raise ValueError(f"a stream event that is not JSON: {data[:80]!r}") from None
    if isinstance(event, dict) and "error" in event:
        error = event["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        raise ValueError(f"an error event: {message}")
    choices = event.get("choices") if isinstance(event, dict) else None
    if choices == []:
        return ""
    try:
        text = choices[0]["text"]
    except (TypeError, KeyError, IndexError):
        text = None
    if not isinstance(text, str):
        raise ValueError(f"a stream event without a choice's text: {data[:80]!r}")
    return text


def _body(request: TraceRequest, model: str) -> dict[str, object]:
    return {
        "model": model,
        "prompt": prompt_text(request),
        "max_tokens": request.output_tokens,
        "stream": True,
    }


def _headers(request: TraceRequest, clock: _Clock) -> dict[str, str]:
    headers = {CLASS_HEADER: request.task_class.value}
    if request.deadline_s is not None:
        headers[DEADLINE_HEADER] = f"{request.deadline_s / clock.speedup:.6g}"
    return headers


def _refused(
    request: TraceRequest, response: httpx.Response, sent: float, clock: _Clock
) -> ReplayRecord:
    status = response.status_code
    retry_after = response.headers.get("retry-after")
    refusal = status in REFUSALS
    return ReplayRecord(
        request.request_id,
        status,
        None,
        (time.monotonic() - sent) * clock.speedup,
        0,
        request.task_class.value,
        "rejected" if refusal else "failed",
        None if retry_after is None else _retry_after_s(retry_after, clock.speedup),
        response.headers.get(REQUEST_ID_HEADER),
        None if refusal else f"HTTP {status}: {_error_message(response)}",
    )


def _error_message(response: httpx.Response) -> str:
    """The message of an error answer in OpenAI's format, else its start."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200] or "(no body)"


def _retry_after_s(value: str, speedup: float) -> float | None:
    """``Retry-After`` in the workload's seconds: a number of seconds, or an HTTP date
    (RFC 9110) less now; None for one that is neither (the client model's delay then)."""
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = (parsedate_to_datetime(value) - datetime.now(UTC)).total_seconds()
        except (TypeError, ValueError):
            return None
    return max(0.0, seconds) * speedup if math.isfinite(seconds) else None


def _record(
    request: TraceRequest, sent: float, seen: _Progress, clock: _Clock, outcome: str
) -> ReplayRecord:
    first = seen.first_token
    ttft = None if first is None else (first - sent) * clock.speedup
    e2e = (time.monotonic() - sent) * clock.speedup
    return ReplayRecord(
        request.request_id,
        seen.status,
        ttft,
        e2e,
        seen.tokens,
        request.task_class.value,
        outcome,
        gateway_request_id=seen.gateway_request_id,
        error=seen.error,
    )
