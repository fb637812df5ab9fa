"""One inference instance, stepped like a vLLM v1 engine.

Each step the scheduler spends a token budget (``max_num_batched_tokens``):

1. running sequences first, in admission order: one token for a decoding sequence, the
   next chunk of the prompt for one still in prefill (chunked prefill);
2. when a running sequence needs a KV block and none is free, a running sequence is
   preempted: its blocks are released and its tokens will be computed again (recompute
   preemption, counted as repeated work), and it goes back to the wait queue. Under the
   default ``fcfs`` policy the victim is the most recently admitted and goes back to the
   head; under ``priority``, the one of lowest priority (highest number), latest arrival
   among equals, as vLLM v1's scheduler picks it, and it rejoins the queue by its key;
3. then, if nothing was preempted, waiting sequences in queue order (``sim.wait_queue``)
   while budget, ``max_num_seqs`` and free blocks allow; each reuses its cached prompt
   prefix.

A sequence's first output token exists at the end of the step that computes its last
prompt token; each later step computes one token's KV and samples the next. The engine
has no clock of its own: the host calls ``plan_step(now)``, waits the returned duration
(in virtual or wall time), then calls ``finish_step`` with the end time.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

from control.admission.registry import EngineScheduling
from control.step_time import StepTime
from sim.kv_cache import KvBlockPool, OutOfBlocks
from sim.wait_queue import WaitQueue, wait_queue
from sim.workload import TraceRequest


class RequestTooLong(ValueError):
    """Prompt plus output budget exceed what the engine can hold (vLLM answers 400)."""


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int | None = None
    """Longest prompt plus output; never more than the KV cache holds."""
    scheduling_policy: EngineScheduling = "fcfs"

    @property
    def max_tokens_per_sequence(self) -> int:
        capacity = self.num_blocks * self.block_size
        return min(self.max_model_len or capacity, capacity)


@dataclass(eq=False, slots=True)
class Sequence:
    """A request inside one engine."""

    request: TraceRequest
    enqueued_s: float
    computed: int = 0
    """Tokens whose KV is computed (prompt and generated)."""
    generated: int = 0
    blocks: list[int] = field(default_factory=list)
    registered: int = 0
    """Leading prompt blocks already registered in the prefix cache."""
    cached_tokens: int = -1
    """Prompt tokens served from the prefix cache at first admission; -1 until then."""
    cached_at_start: int = 0
    """Prompt tokens served from the prefix cache when it last started (it starts again
    after a preemption): of ``computed``, the tokens this start did not compute."""
    scheduled_s: float | None = None
    """When the engine first computed anything for it: the end of its queue wait."""
    first_token_s: float | None = None
    finished_s: float | None = None
    preemptions: int = 0
    recomputed_tokens: int = 0
    cancelled: bool = False
    priority: int = 0
    """The request's priority under ``priority`` scheduling: lower is served first."""

    @property
    def target_tokens(self) -> int:
        """Tokens whose KV must exist before the next output token can be sampled: the
        prompt, then each generated token (its KV is computed in the step after it)."""
        return self.request.input_tokens + self.generated


@dataclass(frozen=True, slots=True)
class StepPlan:
    duration_s: float
    scheduled: tuple[tuple[Sequence, int], ...]
    prefill_tokens: int
    decode_seqs: int


@dataclass(eq=False, slots=True)
class DecodeRun:
    """Consecutive decode-only steps of an unchanging batch, planned at once.

    Planned only when nothing waits and every running sequence is decoding, for as many
    steps as pass before the first of them finishes and as the free blocks allow; so no
    step of the run can change the batch. ``ends_s`` holds each step's end time.
    ``applied`` counts the steps already applied to the sequences.
    """

    sequences: tuple[Sequence, ...]
    start_s: float
    ends_s: list[float]
    applied: int = 0

    @property
    def end_s(self) -> float:
        return self.ends_s[-1]

    def steps_ended_by(self, now: float) -> int:
        return bisect_right(self.ends_s, now)


Plan = StepPlan | DecodeRun
MAX_RUN_STEPS = 4096


@dataclass
class EngineCounters:
    steps: int = 0
    busy_s: float = 0.0
    preemptions: int = 0


class Engine:
    def __init__(
        self, config: EngineConfig, step_time: StepTime, *, kv_events: bool = False
    ) -> None:
        """``kv_events``: the pool logs its stored and evicted blocks (``take_events``)."""
        self.config = config
        self.step_time = step_time
        self.pool = KvBlockPool(config.num_blocks, config.block_size, kv_events=kv_events)
        self.waiting: WaitQueue = wait_queue(config.scheduling_policy)
        self.running: list[Sequence] = []
        self.counters = EngineCounters()
        self.inflight_tokens = 0
        """Prompt plus not-yet-generated output tokens of every sequence held."""

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def accepts(self, request: TraceRequest) -> bool:
        return request.input_tokens + request.output_tokens <= self.config.max_tokens_per_sequence

    def add(self, sequence: Sequence) -> None:
        """Queue a sequence; RequestTooLong if it could never fit."""
        if not self.accepts(sequence.request):
            raise RequestTooLong(
                f"{sequence.request.input_tokens} prompt + {sequence.request.output_tokens} "
                f"output tokens exceed {self.config.max_tokens_per_sequence}"
            )
        self.waiting.add(sequence)
        self.inflight_tokens += sequence.request.input_tokens + sequence.request.output_tokens

    def cancel(self, sequence: Sequence) -> None:
        """Stop a sequence now and free its blocks; a step in flight skips it."""
        sequence.cancelled = True
        if sequence in self.running:
            self.running.remove(sequence)
        elif sequence in self.waiting:
            self.waiting.remove(sequence)
        else:
            return  # already finished or cancelled
        self._release(sequence)
        self.inflight_tokens -= _owed(sequence)

    def plan(self, now: float, *, runs: bool = True) -> Plan | None:
        """What to compute from ``now``: a decode run when ``runs`` allows and the batch
        cannot change, else one step; None when there is nothing to do."""
        if runs and (run := self._plan_run(now)) is not None:
            return run
        return self.plan_step(now)

    def advance(self, run: DecodeRun, now: float) -> list[Sequence]:
        """Apply the run's steps that ended by ``now``; return the sequences finished."""
        steps = run.steps_ended_by(now) - run.applied
        if steps <= 0:
            return []
        previous_end = run.ends_s[run.applied - 1] if run.applied else run.start_s
        run.applied += steps
        end = run.ends_s[run.applied - 1]
        self.counters.steps += steps
        self.counters.busy_s += end - previous_end
        finished = []
        for sequence in run.sequences:
            if sequence.cancelled:
                continue
            sequence.computed += steps
            missing = _blocks_for(sequence.computed, self.pool.block_size) - len(sequence.blocks)
            if missing > 0:  # reserved by _plan_run: a shortage here is a bug, and raises
                sequence.blocks.extend(self.pool.allocate(missing))
            sequence.generated += steps
            self.inflight_tokens -= steps
            if sequence.generated >= sequence.request.output_tokens:
                self._finish(sequence, end)
                finished.append(sequence)
        return finished

    def cut(self, run: DecodeRun) -> None:
        """End the run after the step in flight, so that new work can join the next step."""
        del run.ends_s[min(run.applied + 1, len(run.ends_s)) :]

    def _plan_run(self, now: float) -> DecodeRun | None:
        if self.waiting or len(self.running) < 1:
            return None
        if any(s.generated == 0 or s.computed + 1 != s.target_tokens for s in self.running):
            return None
        steps = min(s.request.output_tokens - s.generated for s in self.running)
        steps = min(steps, MAX_RUN_STEPS)
        while steps > 1 and self._blocks_for_run(steps) > self.pool.free_blocks:
            steps //= 2
        if steps < 2:
            return None
        batch = len(self.running)
        context = sum(s.computed for s in self.running)
        ends, end = [], now
        for step in range(steps):
            end += self.step_time.step_s(0, 0, batch, context + step * batch)
            ends.append(end)
        return DecodeRun(tuple(self.running), now, ends)

    def _blocks_for_run(self, steps: int) -> int:
        size = self.pool.block_size
        return sum(_blocks_for(s.computed + steps, size) - len(s.blocks) for s in self.running)

    def plan_step(self, now: float) -> StepPlan | None:
        """Choose what the step starting at ``now`` computes; None when there is nothing."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preemptions_before = self.counters.preemptions
        for sequence in list(self.running):
            if budget == 0:
                break
            if sequence not in self.running:
                continue  # preempted earlier in this loop
            tokens = min(sequence.target_tokens - sequence.computed, budget)
            preemptions = self.counters.preemptions
            grew = self._grow(sequence, tokens)
            if self.counters.preemptions != preemptions:
                budget += self._unschedule_preempted(scheduled)
            if not grew:  # it was the victim itself: nothing after it runs this step
                break
            scheduled.append((sequence, tokens))
            budget -= tokens
        if self.counters.preemptions == preemptions_before:
            self._admit_waiting(budget, scheduled, now)
        if not scheduled:
            # a step whose preemptions left it empty (upstream, an empty step): plan again
            return self.plan_step(now) if self.running or self.waiting else None
        return self._plan(scheduled)

    def finish_step(self, plan: StepPlan, end_s: float) -> list[Sequence]:
        """Apply a planned step that ended at ``end_s``; return the sequences it finished."""
        self.counters.steps += 1
        self.counters.busy_s += plan.duration_s
        finished = []
        for sequence, tokens in plan.scheduled:
            if sequence.cancelled:
                continue
            sequence.computed += tokens
            self._register_full_blocks(sequence)
            if sequence.computed >= sequence.target_tokens:
                self._emit_token(sequence, end_s)
                if sequence.generated >= sequence.request.output_tokens:
                    self._finish(sequence, end_s)
                    finished.append(sequence)
        return finished

    def _finish(self, sequence: Sequence, end_s: float) -> None:
        sequence.finished_s = end_s
        self.running.remove(sequence)
        self._release(sequence)
        self.inflight_tokens -= _owed(sequence)

    def _admit_waiting(
        self, budget: int, scheduled: list[tuple[Sequence, int]], now: float
    ) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            sequence = self.waiting.peek()
            if not self._start(sequence, budget):
                break
            self.waiting.pop()
            self.running.append(sequence)
            if sequence.scheduled_s is None:
                sequence.scheduled_s = now
            tokens = min(sequence.target_tokens - sequence.computed, budget)
            scheduled.append((sequence, tokens))
            budget -= tokens

    def _start(self, sequence: Sequence, budget: int) -> bool:
        """Reuse the cached prefix and take blocks for the first chunk, all or nothing."""
        pool = self.pool
        request = sequence.request
        target = sequence.target_tokens
        cached = pool.usable_prefix(request.prefix_blocks, target)
        tokens = min(target - cached * pool.block_size, budget)
        new_blocks = _blocks_for(cached * pool.block_size + tokens, pool.block_size) - cached
        try:
            blocks, cached_tokens = pool.start_prompt(
                request.prefix_blocks, target, new_blocks, resumed=sequence.preemptions > 0
            )
        except OutOfBlocks:
            return False
        sequence.blocks = blocks
        sequence.computed = sequence.cached_at_start = cached_tokens
        sequence.registered = cached_tokens // pool.block_size
        if sequence.cached_tokens < 0:
            sequence.cached_tokens = cached_tokens
        return True

    def _grow(self, sequence: Sequence, tokens: int) -> bool:
        """Take the blocks ``tokens`` more need, preempting the newest running sequences
        while none are free. False when ``sequence`` itself had to go."""
        needed = _blocks_for(sequence.computed + tokens, self.pool.block_size) - len(
            sequence.blocks
        )
        while needed > 0:
            try:
                sequence.blocks.extend(self.pool.allocate(needed))
                return True
            except OutOfBlocks:
                victim = self._victim()
                self._preempt(victim)
                if victim is sequence:
                    return False
        return True

    def _victim(self) -> Sequence:
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=lambda s: (s.priority, s.enqueued_s))
        return self.running[-1]

    def _unschedule_preempted(self, scheduled: list[tuple[Sequence, int]]) -> int:
        """Drop from this step's plan the sequences preempted after it took them (under
        ``priority`` the victim may be one already planned); return their tokens."""
        kept = [(s, tokens) for s, tokens in scheduled if s in self.running]
        freed = sum(tokens for _, tokens in scheduled) - sum(tokens for _, tokens in kept)
        scheduled[:] = kept
        return freed

    def _preempt(self, sequence: Sequence) -> None:
        self.running.remove(sequence)
        self._release(sequence)
        sequence.recomputed_tokens += sequence.computed - sequence.cached_at_start
        sequence.computed = sequence.cached_at_start = 0
        sequence.registered = 0
        sequence.preemptions += 1
        self.counters.preemptions += 1
        self.waiting.put_back(sequence)

    def _release(self, sequence: Sequence) -> None:
        self.pool.release(sequence.blocks)
        sequence.blocks = []

    def _register_full_blocks(self, sequence: Sequence) -> None:
        hashes = sequence.request.prefix_blocks
        full = min(sequence.computed // self.pool.block_size, len(hashes))
        for index in range(sequence.registered, full):
            self.pool.register(sequence.blocks[index], hashes[index])
        sequence.registered = max(sequence.registered, full)

    def _emit_token(self, sequence: Sequence, end_s: float) -> None:
        sequence.generated += 1
        self.inflight_tokens -= 1
        if sequence.first_token_s is None:
            sequence.first_token_s = end_s

    def _plan(self, scheduled: list[tuple[Sequence, int]]) -> StepPlan:
        prefill_tokens = prefill_pairs = decode_seqs = decode_context = 0
        for sequence, tokens in scheduled:
            if sequence.generated and sequence.computed + 1 == sequence.target_tokens:
                decode_seqs += 1
                decode_context += sequence.computed
            else:
                prefill_tokens += tokens
                prefill_pairs += tokens * sequence.computed + tokens * (tokens + 1) // 2
        duration = self.step_time.step_s(prefill_tokens, prefill_pairs, decode_seqs, decode_context)
        return StepPlan(duration, tuple(scheduled), prefill_tokens, decode_seqs)


def _owed(sequence: Sequence) -> int:
    request = sequence.request
    return request.input_tokens + request.output_tokens - sequence.generated


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)
