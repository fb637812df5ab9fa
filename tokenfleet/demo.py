"""The embedded main job: no Kafka, no Redis, everything in one process.

Until the simulator lands, it replays a slice of the Mooncake conversation trace as
``RequestArrived`` events through the in-memory bus, and a consumer measures from the
events alone what a perfect prefix cache could reuse.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from schemas import Envelope, TaskClass
from schemas.lifecycle import RequestArrived
from sim.traces import load_mooncake
from sim.workload import TraceRequest, leading_prefix_hits
from streams import InMemoryBus


@dataclass(frozen=True)
class DemoReport:
    requests: int
    input_tokens: int
    output_tokens: int
    prefix_hit_share: float
    events_per_s: float

    def lines(self) -> list[str]:
        return [
            f"requests replayed through the in-memory bus: {self.requests}",
            f"prompt tokens: {self.input_tokens:,}   output tokens: {self.output_tokens:,}",
            f"prompt blocks an unbounded prefix cache could reuse: {self.prefix_hit_share:.1%}",
            f"bus throughput (publish, decode, consume): {self.events_per_s:,.0f} events/s",
        ]


def arrived(request: TraceRequest) -> Envelope:
    payload = RequestArrived(
        request_id=request.request_id,
        tenant="mooncake",
        task_class=TaskClass.INTERACTIVE,
        model="conversation",
        input_tokens=request.input_tokens,
        output_budget=max(request.output_tokens, 1),
        prefix_blocks=request.prefix_blocks,
        source_region="local",
    )
    return Envelope.wrap(payload, source="demo", ts=request.arrival_s)


async def run_demo(limit: int, seed: int) -> DemoReport:
    requests = load_mooncake(limit=limit, seed=seed)
    bus = InMemoryBus(source="demo")
    started = time.perf_counter()
    for request in requests:
        await bus.publish_event(arrived(request))
    payloads: list[RequestArrived] = []
    async with bus.subscribe("tf.requests") as events:
        async for event in events:
            payloads.append(event.envelope.payload)
            if len(payloads) == len(requests):
                break
    elapsed = time.perf_counter() - started
    payloads.sort(key=lambda p: int(p.request_id.rsplit("-", 1)[1]))
    hits, blocks = leading_prefix_hits([p.prefix_blocks for p in payloads])
    return DemoReport(
        requests=len(payloads),
        input_tokens=sum(p.input_tokens for p in payloads),
        output_tokens=sum(p.output_budget for p in payloads),
        prefix_hit_share=hits / blocks if blocks else 0.0,
        events_per_s=len(payloads) / elapsed,
    )


def main(limit: int, seed: int) -> int:
    report = asyncio.run(run_demo(limit, seed))
    print("\n".join(report.lines()))
    return 0
