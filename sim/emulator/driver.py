"""Steps one engine in wall-clock time, ``speedup`` times faster than the model says.

Virtual time runs at ``speedup`` x wall time from the driver's start. While the engine is
busy, each step starts in virtual time exactly when the previous one ended and sleeps until
its own absolute end, so the event loop's lateness does not pile up step after step (the
model's step times already include a real engine's scheduling overhead). After a stall of
more than ``MAX_LAG_S`` the clock resynchronises. Requests join at the next step, as in
vLLM. Each sequence gets an asyncio queue that receives, after every step that gave
it tokens, how many it got; ``None`` ends the stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from sim.engine import Engine, Sequence, StepPlan
from sim.workload import TraceRequest

MAX_LAG_S = 0.5
"""Virtual seconds the stepping may fall behind the clock before it resynchronises."""


class EngineDriver:
    def __init__(
        self,
        engine: Engine,
        speedup: float = 1.0,
        on_finish: Callable[[Sequence], None] | None = None,
        on_step: Callable[[], None] | None = None,
    ) -> None:
        """``on_finish`` is called with each finished sequence, ``on_step`` after each step."""
        if speedup <= 0:
            raise ValueError("speedup must be positive")
        self.engine = engine
        self.speedup = speedup
        self._on_finish = on_finish
        self._on_step = on_step
        self._start = time.monotonic()
        self._wake = asyncio.Event()
        self._streams: dict[Sequence, asyncio.Queue[int | None]] = {}

    def now(self) -> float:
        """Virtual seconds since the driver started."""
        return (time.monotonic() - self._start) * self.speedup

    def api_overhead_s(self) -> float:
        """Wall seconds the model's fixed API overhead on TTFT takes at this speed-up."""
        return self.engine.step_time.ttft_overhead_s / self.speedup

    def submit(
        self, request: TraceRequest, priority: int = 0
    ) -> tuple[Sequence, asyncio.Queue[int | None]]:
        """Queue a request (RequestTooLong if it can never fit); returns its token stream.
        ``priority`` counts where the engine schedules by priority."""
        sequence = Sequence(request, self.now(), priority=priority)
        self.engine.add(sequence)
        stream: asyncio.Queue[int | None] = asyncio.Queue()
        self._streams[sequence] = stream
        self._wake.set()
        return sequence, stream

    def cancel(self, sequence: Sequence) -> None:
        """The client went away: free the sequence's blocks now."""
        if self._streams.pop(sequence, None) is not None and sequence.finished_s is None:
            self.engine.cancel(sequence)

    async def run(self) -> None:
        """Step forever; idle while there is nothing to do."""
        cursor = self.now()
        while True:
            if self.now() - cursor > MAX_LAG_S:
                cursor = self.now()
            plan = self.engine.plan_step(cursor)
            if plan is None:
                self._wake.clear()
                await self._wake.wait()
                cursor = self.now()
                continue
            cursor = await self._step(plan, cursor)

    async def _step(self, plan: StepPlan, start: float) -> float:
        """Run a step that started at virtual ``start``; returns its virtual end."""
        end = start + plan.duration_s
        await asyncio.sleep(max(0.0, end / self.speedup - (time.monotonic() - self._start)))
        before = {sequence: sequence.generated for sequence, _ in plan.scheduled}
        finished = set(self.engine.finish_step(plan, end))
        for sequence, generated in before.items():
            stream = self._streams.get(sequence)
            if stream is None:
                continue
            if sequence.generated > generated:
                stream.put_nowait(sequence.generated - generated)
            if sequence in finished:
                stream.put_nowait(None)
                del self._streams[sequence]
        if self._on_finish is not None:
            for sequence in finished:
                self._on_finish(sequence)
        if self._on_step is not None:
            self._on_step()
        return end
