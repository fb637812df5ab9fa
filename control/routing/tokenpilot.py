"""TokenPilot: route each request to the instance with the lowest predicted time to first
token, weighing the prefix cache it would reuse against the queue it would join, plus the
delay its own prefill adds to the requests that will queue behind it.

For every candidate, vectorised over instances:

- **reusable prefix**: the request's leading blocks the approximate index places there,
  at most all but the last token. The index is written in routing order, so every request
  already queued there has written its blocks and evicted what it would evict: the match
  is what should still be cached when this request's turn comes;
- **queue** (``queue_s``): time for the candidate to prefill the tokens ahead of the
  request, each step sharing its token budget with the candidate's decoding sequences and
  paying their cost, by the pool's calibrated step model. Tokens ahead are the largest of
  this router's ledger of what it sent there, the hosts' shared count of prefill tokens
  awaiting a first token (all gateways), and the candidate's scraped waiting requests
  times the mean prompt seen: the scrape also sees queues neither count can (traffic from
  elsewhere, requests held back by KV or ``max_num_seqs`` limits);
- **the step in flight** (``wait_s``, ``unstarted_tokens``): where the host has seen the
  candidate's last step end (tokens streamed back), the requests this router sent since
  cannot be in the step that began then; they will share their first step with this
  request. The rest of the queue is in flight, and the request waits only what remains of
  it, or of the decoding step when nothing is: arrivals that land just as a step ends
  wait least. The host sees a step end late; the lag assumed is learned from the first
  tokens of requests that had nothing queued ahead (``TokenLag``);
- **prefill** (``prefill_s``): the same for the request's own uncached tokens, plus their
  attention over the cached context;
- **correction**: times the candidate's learned ratio of observed to predicted TTFT;
- **delay to others** (``delay_to_others_s``): the time the request's prefill adds to the
  candidate's timeline (``work_s``: its steps' time beyond what the same steps would take
  without it, so not the decoding it waits for) times the requests expected to queue
  behind it, the pool's mean queue in prompts; plus what its first chunk adds to the step
  it shares with the unstarted requests ahead (``shared_step_s`` times
  ``unstarted_ahead``), each of whose first tokens it delays; all corrected. On an idle
  pool it is nothing and the fastest first token wins; on a saturated one each recomputed
  token is capacity every later request waits for, so cache hits weigh more than short
  queues;
- **KV pressure** (``kv_pressure``): the sum of the above is weighed by one plus the share
  of the candidate's KV blocks in use, so that time on a full cache counts double. A fuller
  cache keeps fewer idle prefixes (the conversations homed there lose theirs sooner) and
  decodes every step over more context; scoring time alone left the instances' KV use
  uneven and their caches holding less that later prompts could reuse.

Candidates must be ready, have free KV blocks for the request's uncached prompt and fewer
than 256 waiting requests; when none has, the ready instance with the lowest score takes
the request (never refuse for load). Scores within 2 % of the best are ties: the one with
the fewest tokens in flight wins, then the one sent work least recently. The decision
record keeps every term of every candidate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated

import numpy as np
from pydantic import Field

from control.routing.estimators import (
    AwaitingOutcome,
    BiasCorrection,
    OutputLengths,
    TokenLag,
    WorkLedger,
)
from control.routing.prefix_index import ApproximatePrefixIndex
from control.routing.snapshot import (
    CACHED_TOKENS,
    PREDICTED_TTFT_S,
    Decision,
    FleetSnapshot,
    FloatArray,
    KvEvent,
    Observation,
    PoolModel,
    RouteRequest,
    TtftPrediction,
)
from control.step_time import Seconds, StepsUnderLoad
from control.tokens import BLOCK_TOKENS


@dataclass(frozen=True)
class TokenPilotParams:
    max_waiting: Annotated[int, Field(ge=1)] = 256
    """Candidates with more waiting requests are filtered out (unless all are)."""
    index_stride: Annotated[int, Field(ge=1)] = 8
    """Index every 8th block: an eighth of the work, 128-token match granularity. Every
    4th took a decision 14 % longer at the median, and its P99 at 1,024 instances over
    1 ms in five runs of six on this project's machine, for routing figures that moved
    both ways (``docs/routing.md``, "An index of every eighth block")."""
    tie_band: Annotated[float, Field(ge=0)] = 0.02
    """Scores within 2 % of the best are ties, below what the step model resolves (its
    calibration matches vLLM's time per output token within 2 %, docs/validation.md)."""
    token_lag_s: Annotated[float, Field(ge=0, le=1)] = 0.004
    """From a step's end to its streamed tokens reaching the host (the engine's output
    path, detokenising, the network): the host sees each step begin this much late. The
    least lag assumed: set it to what the deployment measures (the gateway's
    ``token_lag_s`` setting). Too high costs less than too low: on the Azure trace, a
    host 3 ms later than assumed lost the whole gain of knowing the steps' phase, one 2 ms
    earlier less than a quarter of it (``docs/routing.md``, "The step in flight"); the
    simulator's host is 2 ms late. With ``learn_token_lag`` a host seen later than this
    raises it."""
    learn_token_lag: bool = True
    """Raise the lag assumed when first tokens show the host later (``TokenLag``)."""
    kv_pressure_weight: Annotated[float, Field(ge=0)] = 1.0
    """Scores are multiplied by ``1 + weight * KV usage``: a full cache's time counts
    double (``docs/routing.md``, "KV pressure")."""


INDEX_STRIDE = TokenPilotParams().index_stride
"""The blocks TokenPilot's index keeps by default (every 8th: hashes chain, so one block
stands for its whole prefix), which the prefix memories kept beside it keep too: the
gateways' shared index and an edge's memory of where prompts went."""


@dataclass(frozen=True, slots=True)
class _Load:
    """What each candidate's steps carry besides prefill: the step model bound to its
    decoding sequences and their context, and the token budget left to prefill
    (``max_num_batched_tokens`` less one per decoding sequence)."""

    steps: StepsUnderLoad
    budget: np.ndarray | int


@dataclass
class _Sent:
    instance: int
    raw_prediction_s: float
    output_key: str
    ledger_entry: int
    phase: tuple[float, float, float, float] | None
    """For ``TokenLag``, when it learns, where nothing was queued ahead and the host had
    seen a step end within the last step and a half: that step end's age, the decoding
    step, the predicted prefill and the correction it was multiplied by."""


@dataclass(frozen=True, slots=True)
class _Predicted:
    """What ``predict_ttft`` computed, kept for the ``route`` of the same request that
    admission calls next (``control/pipeline.py``: admit, then dispatch): on the same
    snapshot's load at the same time, with nothing else told to the router in between,
    the two would compute the same terms twice (about a tenth of the gateway's CPU per
    request). ``route`` counts the request's prompt into the mean first, which sizes the
    candidates' scraped queues: the terms are the same only where the tokens ahead are."""

    request: RouteRequest
    now: float
    load: tuple[np.ndarray, ...]
    parts: dict[str, np.ndarray]

    def serves(
        self, request: RouteRequest, fleet: FleetSnapshot, now: float, ahead: FloatArray
    ) -> bool:
        return (
            request is self.request
            and now == self.now
            and all(a is b for a, b in zip(_load_of(fleet), self.load, strict=True))
            and np.array_equal(ahead, self.parts["ahead_tokens"])
        )


def _load_of(fleet: FleetSnapshot) -> tuple[np.ndarray, ...]:
    """The snapshot's arrays ``_predict`` reads (the read-only arrays themselves: a
    snapshot narrowed to fewer ready instances shares them)."""
    return (
        fleet.waiting,
        fleet.running,
        fleet.kv_blocks_used,
        fleet.kv_block_size,
        fleet.pending_prefill_tokens,
        fleet.last_step_end_s,
    )


@dataclass
class TokenPilot:
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
        self._predicted: _Predicted | None = None
        self.token_lag = TokenLag(self.params.token_lag_s)
        # An idle engine's load is scalars, which numpy broadcasts: each array operation
        # costs microseconds at a thousand candidates.
        budget = self.pool.max_num_batched_tokens
        self._idle = _Load(self.pool.step_time.under_load(0, 0), budget)
        """Steps that carry nothing but prefill: the request's own work."""

    def route(self, request: RouteRequest, fleet: FleetSnapshot, now: float) -> Decision:
        if not fleet.ready.any():
            return Decision(self.name, None, np.full(len(fleet), np.nan))
        ledger, correction = self._state(len(fleet))
        ledger.advance(now)
        self._count_prompt(request.input_tokens)
        ahead = self._ahead(request, fleet, ledger)
        admitted_on, self._predicted = self._predicted, None
        if admitted_on is not None and admitted_on.serves(request, fleet, now, ahead):
            parts = admitted_on.parts
        else:
            parts = self._predict(request, fleet, ledger, ahead, now)
        del parts["alone_s"]  # admission's, not a term of the decision
        raw = parts["queue_s"] + parts["prefill_s"]
        ratio = correction.ratio
        predicted = raw * ratio
        behind = self._queued_behind(parts["ahead_tokens"], fleet)
        delay = behind * parts["work_s"] + parts["unstarted_ahead"] * parts["shared_step_s"]
        parts["delay_to_others_s"] = delay * ratio
        usage = fleet.kv_blocks_used / np.maximum(fleet.kv_blocks_total, 1)
        parts["kv_pressure"] = 1 + self.params.kv_pressure_weight * usage
        scores = (predicted + parts["delay_to_others_s"]) * parts["kv_pressure"]
        chosen = self._pick(scores, fleet, parts["uncached_tokens"], ledger)
        self._record(
            request, fleet, now, chosen, parts, float(raw[chosen]), float(predicted[chosen])
        )
        parts |= {"correction": ratio, PREDICTED_TTFT_S: predicted}
        return Decision(self.name, chosen, np.where(fleet.ready, scores, np.nan), parts)

    def predict_ttft(
        self, request: RouteRequest, fleet: FleetSnapshot, now: float
    ) -> TtftPrediction:
        """The TTFT a client would see on each instance, as ``route`` predicts it, and on
        the best were it idle, with nothing recorded (for admission, which decides before
        the route is taken)."""
        ledger, correction = self._state(len(fleet))
        ledger.advance(now)
        parts = self._predict(request, fleet, ledger, self._ahead(request, fleet, ledger), now)
        self._predicted = _Predicted(request, now, _load_of(fleet), parts)
        overhead, ratio = self.pool.step_time.ttft_overhead_s, correction.ratio
        loaded = (parts["queue_s"] + parts["prefill_s"]) * ratio
        idle = np.min(np.where(fleet.ready, parts["alone_s"] * ratio, np.inf))
        return TtftPrediction(
            np.where(fleet.ready, loaded + overhead, np.inf), float(idle) + overhead
        )

    def observe(self, observation: Observation) -> None:
        self._predicted = None
        sent = self._sent.pop(observation.request_id)
        if sent is None or self._correction is None:
            return
        engine_ttft_s = observation.ttft_s - self.pool.step_time.ttft_overhead_s
        self._correction.observe(sent.instance, sent.raw_prediction_s, engine_ttft_s)
        self.outputs.observe(sent.output_key, observation.output_tokens)
        if sent.phase is not None:
            age, step, prefill, ratio = sent.phase
            self.token_lag.observe(age, step, engine_ttft_s / ratio - prefill)

    def withdraw(self, request_id: str) -> None:
        """The host routed this request elsewhere after all (it decided again on a fresher
        view): forget the work counted for it. What the request wrote into this router's
        own prefix index stays; hosts that decide again pass ``known_matches``."""
        self._predicted = None
        sent = self._sent.pop(request_id)
        if sent is not None and self._ledger is not None:
            self._ledger.withdraw(sent.ledger_entry)

    def kv_events(self, instance: int, events: Sequence[KvEvent]) -> None:
        """Evictions correct the index: an engine whose KV is full of running sequences
        keeps far fewer idle prefixes than its size, and forgets them sooner than an LRU
        of that size would. Stored blocks add nothing: the index recorded each request's
        blocks when it routed it, before the engine computed them."""
        self._predicted = None
        self.index.evicted(instance, [block for block, stored in events if not stored])

    def _count_prompt(self, tokens: int) -> None:
        """Keep the moving average of prompt lengths (5 % a request)."""
        if self._mean_prompt_tokens == 0:
            self._mean_prompt_tokens = float(tokens)
        self._mean_prompt_tokens += 0.05 * (tokens - self._mean_prompt_tokens)

    def _state(self, instances: int) -> tuple[WorkLedger, BiasCorrection]:
        if self._ledger is None or len(self._ledger.prefill_tokens) != instances:
            self._ledger, self._correction = WorkLedger(instances), BiasCorrection(instances)
        assert self._correction is not None
        return self._ledger, self._correction

    def _ahead(self, request: RouteRequest, fleet: FleetSnapshot, ledger: WorkLedger) -> FloatArray:
        """Prompt tokens queued ahead of a new request on each candidate."""
        counted: FloatArray = np.maximum(ledger.prefill_tokens, fleet.pending_prefill_tokens)
        scraped = fleet.waiting * (self._mean_prompt_tokens or request.input_tokens)
        ahead: FloatArray = np.maximum(counted, scraped)
        return ahead

    def _predict(
        self,
        request: RouteRequest,
        fleet: FleetSnapshot,
        ledger: WorkLedger,
        ahead: FloatArray,
        now: float,
    ) -> dict[str, np.ndarray]:
        prompt = request.input_tokens
        matched = request.known_matches
        if matched is None:
            matched = self.index.match(request.prefix_blocks, len(fleet))
        # An engine reuses whole blocks of its own, and recomputes the prompt's last token.
        shared = np.minimum(matched * BLOCK_TOKENS, max(prompt - 1, 0))
        # Token counts as floats from here: an operation mixing integer and float arrays
        # takes about twice as long as one on floats alone.
        blocks = fleet.kv_block_size
        cached = np.multiply(shared // blocks, blocks, dtype=np.float64)
        uncached = prompt - cached
        decoders = np.maximum(fleet.running, ledger.decoding)
        context = fleet.kv_tokens_used.astype(np.float64)
        model = self.pool.step_time
        budget = self.pool.max_num_batched_tokens
        load = _Load(model.under_load(decoders, context), np.maximum(budget - decoders, 1))
        tpot = load.steps.decode_step_s(1)
        step, queued = self._step_in_flight(fleet, ledger, ahead, load, tpot, now)
        # Both in one call: each array operation costs microseconds, whatever its size.
        queue, with_own = step["wait_s"] + self._prefill_seconds(
            np.array([queued, queued + uncached]), load
        )
        pairs = uncached * cached + uncached * (uncached + 1) / 2
        attention = model.attention_s(pairs)
        alone = self._prefill_seconds(uncached, self._idle)
        idle_steps_s = np.ceil(uncached / budget) * model.step_s(0, 0, 0, 0)
        return step | {
            "queue_s": queue,
            "prefill_s": with_own - queue + attention,
            "alone_s": alone + attention,
            "work_s": alone - idle_steps_s + attention,
            "shared_step_s": self._shared_step_s(step["unstarted_tokens"], uncached, load),
            CACHED_TOKENS: cached,
            "uncached_tokens": uncached,
            "ahead_tokens": ahead,
            "tpot_s": tpot,
        }

    def _step_in_flight(
        self,
        fleet: FleetSnapshot,
        ledger: WorkLedger,
        ahead: np.ndarray,
        load: _Load,
        decode_step: Seconds,
        now: float,
    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Where each candidate is in its current step, when the host has seen where it
        began (``last_step_end_s``, from the tokens streamed at each step's end); and the
        tokens the request queues behind after ``wait_s``.

        What this router sent since that step began cannot be in it
        (``unstarted_tokens``, ``unstarted_ahead``): such requests share their first
        step with this one. The rest of the tokens ahead are in the step in flight, or
        in the steps after it that finish a prompt already started; the request waits
        what remains of that work (``wait_s``). Without this, an instance whose first
        tokens just came back looked free, though its next step had only begun: on the
        Azure trace TokenPilot's requests waited 0.9 ms longer for a decoding step to
        end than round-robin's, whose arrivals fall at random points of a step.

        ``decode_step``: the candidate's decoding step (with this request among its
        sequences, which changes it by one sequence's cost)."""
        began = fleet.last_step_end_s - self.token_lag.lag_s
        unstarted_tokens, unstarted = ledger.sent_since(began)
        started = np.maximum(ahead - unstarted_tokens, 0)
        # A step with prefill tokens lasts longer than one without (the step model grows
        # with its tokens), so this is the decoding step where nothing is started.
        in_flight = np.maximum(self._prefill_seconds(started, load), decode_step)
        remaining = in_flight - (now - began)
        # The step in flight has ended, its tokens not seen yet: the next began then.
        ended = remaining < 0
        unstarted_tokens, unstarted = ledger.sent_since(began + in_flight * ended)
        wait = remaining + decode_step * ended
        # No tokens for longer than a step more (a long prompt's chunks, or no streamed
        # answers) leave the phase unknown: the whole queue ahead is waited for.
        fresh = wait >= 0
        step = {
            "wait_s": np.maximum(wait, 0.0),
            "unstarted_tokens": unstarted_tokens * fresh,
            "unstarted_ahead": unstarted * fresh,
        }
        return step, np.where(fresh, unstarted_tokens, ahead)

    def _shared_step_s(self, unstarted: np.ndarray, uncached: np.ndarray, load: _Load) -> Seconds:
        """The time this request's first chunk adds to the step that ends the unstarted
        prompts ahead: each of them gets its first token that much later. Where nothing
        is unstarted, that "step" is a full budget that the request cannot join: 0."""
        last = unstarted - np.floor((unstarted - 1) / load.budget) * load.budget
        joined = last + np.minimum(uncached, load.budget - last)
        return load.steps.step_s(joined) - load.steps.step_s(last)

    def _queued_behind(self, ahead_tokens: np.ndarray, fleet: FleetSnapshot) -> float:
        """Requests expected to queue behind this one wherever it goes: the ready
        instances' mean queue, in prompts of the mean length seen."""
        if self._mean_prompt_tokens <= 0:
            return 0.0
        ready = ahead_tokens[fleet.ready]
        # The mean as ``ndarray.mean`` computes it, without its Python wrapper.
        return float(np.add.reduce(ready) / len(ready) / self._mean_prompt_tokens)

    def _prefill_seconds(self, tokens: np.ndarray, load: _Load) -> np.ndarray:
        """Time to push ``tokens`` of prefill through equal chunks, each step also carrying
        the candidates' decoding sequences."""
        steps = np.ceil(tokens / load.budget)
        return steps * load.steps.step_s(tokens / np.maximum(steps, 1))

    def _pick(
        self, scores: np.ndarray, fleet: FleetSnapshot, uncached: np.ndarray, ledger: WorkLedger
    ) -> int:
        """The best eligible candidate. An engine short of free blocks for the prompt
        holds it back or, once its chunks are running, preempts the newest sequence (often
        this prompt itself) to compute it again later: such an instance is no candidate.
        The blocks counted are those free now, not what the prompts queued ahead will
        take: past capacity this gathers the longest prompts where few sequences run
        (``docs/routing.md``, "Past capacity on Mooncake", which says why it stays).

        Among ties (``tie_band``) the candidate with the fewest tokens in flight wins, then
        the one this router sent work least recently. Ties are common on a lightly loaded
        pool, where candidates differ only by a few decoding sequences; spreading them keeps
        a burst of arrivals off one instance, as round-robin does. On the Azure trace at
        half load, the lowest score alone sent 14 % of requests to an instance that had
        been sent one less than 50 ms before. Tokens in flight come first because the host
        shares them between gateway replicas, and a router's own turns are not shared.
        """
        free_blocks = fleet.kv_blocks_total - fleet.kv_blocks_used
        eligible = (
            fleet.ready
            & (uncached / fleet.kv_block_size <= free_blocks)
            & (fleet.waiting < self.params.max_waiting)
        )
        if not eligible.any():
            eligible = fleet.ready
        scores = np.where(eligible, scores, np.inf)
        ties = (scores <= scores.min() * (1 + self.params.tie_band)).nonzero()[0]
        if len(ties) == 1:
            return int(ties[0])
        fewest_first = np.lexsort((ledger.last_entry[ties], fleet.inflight_tokens[ties]))
        return int(ties[fewest_first[0]])

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
        step = float(parts["tpot_s"][chosen])
        decode_s = self.outputs.expected(key, request.output_budget) * step
        assert self._ledger is not None
        entry = self._ledger.add(
            chosen,
            float(parts["uncached_tokens"][chosen]),
            now,
            first_token,
            first_token + decode_s,
        )
        if request.known_matches is None:
            self.index.add(chosen, request.prefix_blocks, fleet.prefix_capacity(chosen))
        age = now - float(fleet.last_step_end_s[chosen])
        phase = None
        learns = self.params.learn_token_lag and raw_prediction_s > 0
        if learns and parts["ahead_tokens"][chosen] == 0 and age < 1.5 * step:
            ratio = prediction_s / raw_prediction_s
            phase = (age, step, float(parts["prefill_s"][chosen]), ratio)
        self._sent.put(request.request_id, _Sent(chosen, raw_prediction_s, key, entry, phase))
