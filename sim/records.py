"""One record per request, as a simulator (or a replay) observed it."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from sim.engine import Sequence
from sim.workload import TraceRequest


@dataclass(frozen=True, slots=True)
class RequestRecord:
    request_id: str
    task_class: str
    tenant: str
    outcome: str
    """``completed``, ``rejected`` or ``cancelled`` (by its client)."""
    arrival_s: float
    dc: str | None
    instance_id: str | None
    queue_wait_s: float | None
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    preemptions: int
    recomputed_tokens: int
    deadline_s: float | None
    lost_work_tokens: int = 0
    """Tokens the engine computed for nothing: KV recomputed after a preemption and, for
    a request that did not complete, the uncached prompt it prefilled and what it
    generated."""
    source_region: str = ""
    """The region whose edge took the request (its trace row's ``region``)."""

    @classmethod
    def completed(
        cls,
        sequence: Sequence,
        instance_id: str,
        dc: str,
        *,
        ttft_overhead_s: float,
        token_overhead_s: float,
    ) -> RequestRecord:
        """A finished sequence; the overheads are latencies the client sees on top of the
        engine's (API work, network), which do not occupy the engine."""
        request = sequence.request
        assert sequence.first_token_s is not None
        assert sequence.finished_s is not None
        assert sequence.scheduled_s is not None
        arrival = request.arrival_s
        ttft = sequence.first_token_s - arrival + ttft_overhead_s
        decode_tokens = request.output_tokens - 1
        decode_s = sequence.finished_s - sequence.first_token_s + decode_tokens * token_overhead_s
        tpot = decode_s / decode_tokens if decode_tokens else 0.0
        return cls(
            request.request_id,
            request.task_class.value,
            request.tenant,
            "completed",
            arrival,
            dc,
            instance_id,
            sequence.scheduled_s - sequence.enqueued_s,
            ttft,
            tpot,
            ttft + decode_s,
            request.input_tokens,
            max(sequence.cached_tokens, 0),
            request.output_tokens,
            sequence.preemptions,
            sequence.recomputed_tokens,
            request.deadline_s,
            sequence.recomputed_tokens,
            request.region,
        )

    @classmethod
    def rejected(cls, request: TraceRequest, at_s: float) -> RequestRecord:
        """Refused (or answered from a pool whose hold ran out) at ``at_s``: nothing ran."""
        return cls.unfinished("rejected", request, at_s, None, None, None)

    @classmethod
    def cancelled(
        cls,
        request: TraceRequest,
        at_s: float,
        where: tuple[str, str] | None,
        sequence: Sequence | None,
    ) -> RequestRecord:
        """Given up by its client at ``at_s``: held (``where`` None) or on an instance
        (its id and DC), where ``sequence`` holds what the engine had done for it."""
        instance, dc = where or (None, None)
        return cls.unfinished("cancelled", request, at_s, instance, dc, sequence)

    @classmethod
    def unfinished(
        cls,
        outcome: str,
        request: TraceRequest,
        at_s: float,
        instance_id: str | None,
        dc: str | None,
        sequence: Sequence | None,
    ) -> RequestRecord:
        """A request that did not complete; ``arrival_s`` holds when it ended, and
        ``output_tokens`` the tokens generated for it (wasted)."""
        return cls(
            request.request_id,
            request.task_class.value,
            request.tenant,
            outcome,
            at_s,
            dc,
            instance_id,
            None,
            None,
            None,
            None,
            request.input_tokens,
            0 if sequence is None else max(sequence.cached_tokens, 0),
            0 if sequence is None else sequence.generated,
            0 if sequence is None else sequence.preemptions,
            0 if sequence is None else sequence.recomputed_tokens,
            request.deadline_s,
            0 if sequence is None else _lost_work(sequence),
            request.region,
        )

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _lost_work(sequence: Sequence) -> int:
    """What an unfinished sequence cost the engine: every token computed, less the prefix
    it found cached at each start."""
    return sequence.recomputed_tokens + sequence.computed - sequence.cached_at_start
