"""A simulated run as the lifecycle events a gateway would have published."""

from __future__ import annotations

from collections.abc import Iterable

from schemas import Envelope
from schemas.base import TaskClass
from schemas.lifecycle import FirstToken, RequestArrived, RequestCompleted, RequestRouted
from sim.records import RequestRecord


def lifecycle_events(
    records: Iterable[RequestRecord], model: str, epoch: float = 0.0, source: str = "sim"
) -> list[Envelope]:
    """Arrived, routed, first token and completed for each completed request, stamped at
    ``epoch`` plus the simulated times, sorted by time."""
    events = []
    for r in records:
        if r.outcome != "completed":
            continue
        assert r.dc
        assert r.instance_id
        assert r.ttft_s is not None
        assert r.e2e_s is not None
        at = epoch + r.arrival_s
        task_class = TaskClass(r.task_class)
        stamped = (
            (
                at,
                RequestArrived(
                    request_id=r.request_id,
                    tenant=r.tenant,
                    task_class=task_class,
                    model=model,
                    input_tokens=r.input_tokens,
                    output_budget=max(r.output_tokens, 1),
                    source_region=r.source_region or r.dc,
                    deadline_s=r.deadline_s,
                ),
            ),
            (
                at,
                RequestRouted(
                    request_id=r.request_id,
                    dc=r.dc,
                    instance_id=r.instance_id,
                    policy="sim",
                    candidates=(),
                ),
            ),
            (
                at + r.ttft_s,
                FirstToken(request_id=r.request_id, instance_id=r.instance_id, ttft_s=r.ttft_s),
            ),
            (
                at + r.e2e_s,
                RequestCompleted(
                    request_id=r.request_id,
                    dc=r.dc,
                    instance_id=r.instance_id,
                    task_class=task_class,
                    tenant=r.tenant,
                    input_tokens=r.input_tokens,
                    cached_tokens=r.cached_tokens,
                    output_tokens=r.output_tokens,
                    ttft_s=r.ttft_s,
                    tpot_s=r.tpot_s or 0.0,
                    e2e_s=r.e2e_s,
                ),
            ),
        )
        events.extend(Envelope.wrap(p, source=source, ts=ts) for ts, p in stamped)
    return sorted(events, key=lambda e: e.ts)
