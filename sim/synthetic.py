"""Generated workloads: shared-prefix groups with multi-turn sessions, and ServeGen clients.

``shared_prefix`` follows inference-perf's ``shared_prefix`` data type as llm-d's
prefix-cache benchmarks configure it (150 groups of 5 prompts, a 6,000-token system
prompt, 1,200-token questions, 1,000-token outputs). With ``rounds`` > 1 each prompt is a
user's session: its system prompt, every earlier question and answer, then a new question,
so the history grows round by round; the next round follows the previous answer after a
think time.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from sim.workload import Segment, TraceRequest, segment_blocks


@dataclass(frozen=True)
class SharedPrefixSpec:
    groups: int = 150
    users_per_group: int = 5
    system_prompt_tokens: int = 6000
    question_tokens: int = 1200
    output_tokens: int = 1000
    rounds: int = 1
    rate_rps: float = 10.0
    """Sessions started per second (Poisson)."""
    think_time_s: float = 5.0
    """Mean pause (exponential) between an answer's expected end and the next question."""


def shared_prefix(
    spec: SharedPrefixSpec = SharedPrefixSpec(), *, limit: int | None = None, seed: int = 0
) -> list[TraceRequest]:
    """Requests of ``spec`` in arrival order; ``limit`` caps their number."""
    rng = random.Random(seed)
    sessions = [(g, u) for g in range(spec.groups) for u in range(spec.users_per_group)]
    total = len(sessions) * spec.rounds
    count = total if limit is None else min(limit, total)
    pending: list[tuple[float, int, int]] = []  # (arrival, session, round)
    start = 0.0
    for index in rng.sample(range(len(sessions)), len(sessions)):
        start += rng.expovariate(spec.rate_rps)
        heapq.heappush(pending, (start, index, 0))
    requests: list[TraceRequest] = []
    while pending and len(requests) < count:
        arrival, index, turn = heapq.heappop(pending)
        requests.append(_turn(spec, sessions[index], index, turn, arrival))
        if turn + 1 < spec.rounds:
            answer_s = spec.output_tokens * 0.03  # a rough 30 ms per token for the answer
            later = arrival + answer_s + rng.expovariate(1 / spec.think_time_s)
            heapq.heappush(pending, (later, index, turn + 1))
    return requests


def _turn(
    spec: SharedPrefixSpec, session: tuple[int, int], index: int, turn: int, arrival: float
) -> TraceRequest:
    group, user = session
    segments: list[Segment] = [(("system", group), spec.system_prompt_tokens)]
    for earlier in range(turn):
        segments.append((("question", group, user, earlier), spec.question_tokens))
        segments.append((("answer", group, user, earlier), spec.output_tokens))
    segments.append((("question", group, user, turn), spec.question_tokens))
    return TraceRequest(
        request_id=f"shared-{index}-{turn}",
        arrival_s=arrival,
        input_tokens=sum(length for _, length in segments),
        output_tokens=spec.output_tokens,
        prefix_blocks=segment_blocks(segments),
        session_id=f"g{group}-u{user}",
        round=turn,
        prefix_group=f"g{group}",
        prefix_tokens=spec.system_prompt_tokens,
    )
