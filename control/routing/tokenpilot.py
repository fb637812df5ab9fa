"""TokenPilot: route each request to the instance with the lowest predicted time to first
token, weighing the prefix cache it would reuse against the queue it would join.

For every candidate, vectorised over instances:

- **reusable prefix**: the request's leading blocks the approximate index places there,
  at most all but the last token, discounted by the chance they survive until the
  request's turn: when the blocks the queue ahead will allocate exceed the free blocks,
  only ``free / ahead`` of the cached blocks are counted;
- **queue** (``queue_s``): time for the candidate to prefill the tokens ahead of the
  request, each step sharing its token budget with the candidate's decoding sequences and
  paying their cost, by the pool's calibrated step model. Tokens ahead are the largest of
  this router's ledger of what it sent there, the hosts' shared count of prefill tokens
  awaiting a first token (all gateways), and the candidate's scraped waiting requests
  times the mean prompt seen: the scrape also sees queues neither count can (traffic from
  elsewhere, requests held back by KV or ``max_num_seqs`` limits);
- **prefill** (``prefill_s``): the same for the request's own uncached tokens, plus their
  attention over the cached context;
- **correction**: times the candidate's learned ratio of observed to predicted TTFT.

Candidates must be ready, under 97 % KV usage and under 256 waiting requests; when none
is, the ready instance with the lowest prediction takes the request (never refuse for
load). Ties break at random. The decision record keeps every term of every candidate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from control.routing.estimators import (
    AwaitingOutcome,
    BiasCorrection,
    OutputLengths,
    WorkLedger,
)
from control.routing.prefix_index import ApproximatePrefixIndex
from control.routing.snapshot import (
    Decision,
    FleetSnapshot,
    Observation,
    PoolModel,
    RouteRequest,
)


@dataclass(frozen=True)
class TokenPilotParams:
    max_kv_usage: float = 0.97
    """Candidates fuller than this are filtered out (unless all are)."""
    max_waiting: int = 256
    """Candidates with more waiting requests are filtered out (unless all are)."""
    index_stride: int = 4
    """Index every 4th block: a quarter of the work, 64-token match granularity."""


@dataclass
class _Sent:
    instance: int
    raw_prediction_s: float
    output_key: str


@dataclass
class TokenPilot:
    rng: np.random.Generator
    pool: PoolModel
    params: TokenPilotParams = field(default_factory=TokenPilotParams)
    name: str = "tokenpilot"

    def __post_init__(self) -> None:
        self.index = ApproximatePrefixIndex(stride=self.params.index_stride)
        self.outputs = OutputLengths()
        self._ledger: WorkLedger | None = None
        self._correction: BiasCorrection | None = None
        self._sent: AwaitingOutcome[_Sent] = AwaitingOutcome()
        self._mean_prompt_tokens = 0.0
        """Moving average of prompt lengths, to size queues known only by their count."""

    def route(self, request: RouteRequest, fleet: FleetSnapshot, now: float) -> Decision:
        if not fleet.ready.any():
            return Decision(self.name, None, np.full(len(fleet), np.nan))
        ledger, correction = self._state(len(fleet))
        ledger.advance(now)
        parts = self._predict(request, fleet, ledger)
        raw = parts["queue_s"] + parts["prefill_s"]
        predicted = raw * correction.ratio
        chosen = self._pick(predicted, fleet)
        self._record(
            request, fleet, now, chosen, parts, float(raw[chosen]), float(predicted[chosen])
        )
        parts |= {"correction": correction.ratio}
        return Decision(self.name, chosen, np.where(fleet.ready, predicted, np.nan), parts)

    def observe(self, observation: Observation) -> None:
        sent = self._sent.pop(observation.request_id)
        if sent is None or self._correction is None:
            return
        overhead = self.pool.step_time.ttft_overhead_s
        self._correction.observe(
            sent.instance, sent.raw_prediction_s, observation.ttft_s - overhead
        )
        self.outputs.observe(sent.output_key, observation.output_tokens)

    def _state(self, instances: int) -> tuple[WorkLedger, BiasCorrection]:
        if self._ledger is None or len(self._ledger.prefill_tokens) != instances:
            self._ledger, self._correction = WorkLedger(instances), BiasCorrection(instances)
        assert self._correction is not None
        return self._ledger, self._correction

    def _predict(
        self, request: RouteRequest, fleet: FleetSnapshot, ledger: WorkLedger
    ) -> dict[str, np.ndarray]:
        size = self.pool.block_size
        prompt = request.input_tokens
        matched = request.known_matches
        if matched is None:
            matched = self.index.match(request.prefix_blocks, len(fleet))
        cached_blocks = np.minimum(matched, (prompt - 1) // size)
        self._mean_prompt_tokens += 0.05 * (prompt - self._mean_prompt_tokens)
        ahead = np.maximum.reduce(
            [
                ledger.prefill_tokens,
                fleet.pending_prefill_tokens,
                fleet.waiting * self._mean_prompt_tokens,
            ]
        )
        free_blocks = np.maximum(fleet.kv_blocks_total - fleet.kv_blocks_used, 0)
        ahead_blocks = ahead / size
        survival = np.where(
            ahead_blocks <= free_blocks, 1.0, free_blocks / np.maximum(ahead_blocks, 1.0)
        )
        cached = cached_blocks * size * survival
        uncached = prompt - cached
        decoders = np.maximum(fleet.running, ledger.decoding)
        context = fleet.kv_blocks_used * size
        queue = self._prefill_seconds(ahead, decoders, context)
        with_own = self._prefill_seconds(ahead + uncached, decoders, context)
        model = self.pool.step_time
        zero = np.zeros(len(fleet))
        pairs = uncached * cached + uncached * (uncached + 1) / 2
        attention = model.step_s_array(zero, pairs, zero, zero) - model.step_s_array(
            zero, zero, zero, zero
        )
        return {
            "queue_s": queue,
            "prefill_s": with_own - queue + attention,
            "cached_tokens": cached,
            "survival": survival,
            "ahead_tokens": ahead,
            "tpot_s": model.step_s_array(zero, zero, decoders + 1, context),
        }

    def _prefill_seconds(
        self, tokens: np.ndarray, decoders: np.ndarray, context: np.ndarray
    ) -> np.ndarray:
        """Time to push ``tokens`` of prefill through equal chunks, each step also carrying
        ``decoders`` decoding sequences over ``context`` tokens."""
        budget = np.maximum(self.pool.max_num_batched_tokens - decoders, 1)
        steps = np.ceil(tokens / budget)
        chunk = tokens / np.maximum(steps, 1)
        per_step = self.pool.step_time.step_s_array(chunk, np.zeros_like(chunk), decoders, context)
        return steps * per_step

    def _pick(self, predicted: np.ndarray, fleet: FleetSnapshot) -> int:
        usage = fleet.kv_blocks_used / np.maximum(fleet.kv_blocks_total, 1)
        eligible = (
            fleet.ready
            & (usage < self.params.max_kv_usage)
            & (fleet.waiting < self.params.max_waiting)
        )
        if not eligible.any():
            eligible = fleet.ready
        scores = np.where(eligible, predicted, np.nan)
        best = np.flatnonzero(scores == np.nanmin(scores))
        return int(best[self.rng.integers(best.size)])

    def _record(
        self,
        request: RouteRequest,
        fleet: FleetSnapshot,
        now: float,
        chosen: int,
        parts: dict[str, np.ndarray],
        raw_prediction_s: float,
        prediction_s: float,
    ) -> None:
        key = request.task_class
        first_token = now + prediction_s
        decode_s = self.outputs.expected(key, request.output_budget) * parts["tpot_s"][chosen]
        assert self._ledger is not None
        self._ledger.add(
            chosen,
            float(request.input_tokens - parts["cached_tokens"][chosen]),
            first_token,
            first_token + decode_s,
        )
        if request.known_matches is None:
            self.index.add(chosen, request.prefix_blocks, int(fleet.kv_blocks_total[chosen]))
        self._sent.put(request.request_id, _Sent(chosen, raw_prediction_s, key))
