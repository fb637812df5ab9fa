"""The online estimators TokenPilot keeps: work it has sent, outputs, its own bias, and how
late its host sees steps end."""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from schemas.openai_api import DEFAULT_CHAT_TOKENS

V = TypeVar("V")


class AwaitingOutcome(Generic[V]):
    """What a learning router remembers of each request until its outcome is observed.

    Some outcomes never come (a request that failed, or whose host reports only streamed
    completions), so the oldest entries are dropped beyond ``capacity``.
    """

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, request_id: str, value: V) -> None:
        self._entries[request_id] = value
        if len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def pop(self, request_id: str) -> V | None:
        return self._entries.pop(request_id, None)


RECENT_SENDS = 256
"""Sends the ledger remembers for ``sent_since``: more than a router makes within one
engine step (tens of milliseconds) at any rate it decides (a few thousand a second)."""


class WorkLedger:
    """Per-instance work this router sent and believes not yet done.

    Each routed request adds its uncached prompt tokens to the instance's pending prefill
    until its predicted first token, then counts as one decoding sequence until its
    predicted finish. Entries expire by predicted time, so the ledger needs no feedback;
    a host that routes a request elsewhere after all withdraws its entry.
    """

    def __init__(self, instances: int) -> None:
        self.prefill_tokens = np.zeros(instances, dtype=np.float64)
        self.decoding = np.zeros(instances, dtype=np.float64)
        self.last_entry = np.zeros(instances, dtype=np.int64)
        """Each instance's newest entry (0: none yet): the order in which they were last sent
        work."""
        self._recent_s = np.full(RECENT_SENDS, -np.inf)  # the last sends, a ring by entry
        self._recent_instance = np.zeros(RECENT_SENDS, dtype=np.int64)
        self._recent_tokens = np.zeros(RECENT_SENDS)
        self._events: list[tuple[float, int, bool]] = []  # (time, entry, is the finish)
        self._open: dict[int, tuple[int, float, bool]] = {}  # instance, tokens, decoding
        self._entries = 0

    def add(
        self, instance: int, tokens: float, sent_at: float, first_token_at: float, finish_at: float
    ) -> int:
        """Count a routed request; returns its entry, for ``withdraw``."""
        self._entries += 1
        entry = self._entries
        self.last_entry[instance] = entry
        slot = entry % RECENT_SENDS
        self._recent_s[slot] = sent_at
        self._recent_instance[slot] = instance
        self._recent_tokens[slot] = tokens
        self.prefill_tokens[instance] += tokens
        self._open[entry] = (instance, tokens, False)
        heapq.heappush(self._events, (first_token_at, entry, False))
        heapq.heappush(self._events, (finish_at, entry, True))
        return entry

    def advance(self, now: float) -> None:
        """Retire what should have happened by ``now``."""
        while self._events and self._events[0][0] <= now:
            _, entry, finish = heapq.heappop(self._events)
            if entry in self._open:
                self._retire(entry, finished=finish)

    def sent_since(self, began: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Uncached tokens, and requests, sent to each instance after its ``began``."""
        after = self._recent_s > began[self._recent_instance]
        rows = self._recent_instance[after]
        size = len(began)
        tokens = np.bincount(rows, self._recent_tokens[after], minlength=size)
        return tokens, np.bincount(rows, minlength=size)

    def withdraw(self, entry: int) -> None:
        """Forget an entry whose request did not go where it was counted."""
        if entry in self._open:
            self._retire(entry, finished=True)
        if self._entries - entry < RECENT_SENDS:
            self._recent_s[entry % RECENT_SENDS] = -np.inf

    def _retire(self, entry: int, *, finished: bool) -> None:
        instance, tokens, decoding = self._open.pop(entry)
        if decoding:
            self.decoding[instance] -= 1
        else:
            self.prefill_tokens[instance] -= tokens
            if not finished:  # prefill done: the request starts decoding
                self.decoding[instance] += 1
                self._open[entry] = (instance, tokens, True)


@dataclass
class OutputLengths:
    """Expected output tokens per key (a task class), as an exponential moving average of
    completions seen; the client's budget, where it set one, is only a cap. Before any
    completion, half the budget, or ``first_guess`` tokens without one."""

    smoothing: float = 0.05
    first_guess: float = float(DEFAULT_CHAT_TOKENS)
    """What a request with no budget is expected to generate until completions teach
    otherwise: the gateway's default for a chat request that names no limit
    (``schemas.openai_api.DEFAULT_CHAT_TOKENS``)."""

    def __post_init__(self) -> None:
        self._mean: dict[str, float] = {}

    def expected(self, key: str, budget: int | None) -> float:
        mean = self._mean.get(key)
        if mean is None:
            return self.first_guess if budget is None else budget / 2
        return mean if budget is None else min(mean, float(budget))

    def observe(self, key: str, output_tokens: int) -> None:
        mean = self._mean.get(key)
        self._mean[key] = (
            float(output_tokens)
            if mean is None
            else (mean + self.smoothing * (output_tokens - mean))
        )


class BiasCorrection:
    """Ratio of observed to predicted TTFT per instance, which predictions are multiplied
    by: a pool-wide part learned from every observation, times each instance's own
    deviation from it, learned ten times slower (moving averages of log ratios, each
    clipped to [1/4, 4]).

    Instances of a pool run one model on one kind of hardware, so most of a prediction's
    error is shared, and every observation informs it. A ratio learned per instance from
    its own observations alone is noisy, and the noise steers routing: an instance whose
    ratio drifts high gets no requests, so no observation brings it back. On the Azure
    trace one of 16 instances sat at 1.43 against 1.22 to 1.35 for the others, with a fifth
    of their running sequences, while the others ran more than round-robin would give them.
    A real difference, such as a slower GPU or a noisy neighbour, persists, and the slow
    deviation still learns it.
    """

    def __init__(
        self, instances: int, smoothing: float = 0.1, instance_smoothing: float = 0.01
    ) -> None:
        self._pool = 0.0
        self._deviation = np.zeros(instances, dtype=np.float64)
        # Both parts as ratios too, kept by ``observe``: an ``exp`` over every instance at
        # each decision took 12 µs at a thousand instances.
        self._pool_ratio = 1.0
        self._instance_ratio = np.ones(instances, dtype=np.float64)
        self.smoothing = smoothing
        self.instance_smoothing = instance_smoothing

    @property
    def ratio(self) -> np.ndarray:
        return self._pool_ratio * self._instance_ratio

    def observe(self, instance: int, raw_prediction_s: float, observed_s: float) -> None:
        """Move towards ``observed / raw prediction`` (the prediction before correction)."""
        if raw_prediction_s <= 0 or observed_s <= 0:
            return
        log_ratio = np.log(observed_s / raw_prediction_s)
        pool = self._pool + self.smoothing * (log_ratio - self._pool - self._deviation[instance])
        self._pool = _clip_log_ratio(pool)
        own = log_ratio - self._pool - self._deviation[instance]
        deviation = self._deviation[instance] + self.instance_smoothing * own
        self._deviation[instance] = _clip_log_ratio(deviation)
        self._pool_ratio = math.exp(self._pool)
        self._instance_ratio[instance] = math.exp(self._deviation[instance])


def _clip_log_ratio(value: float) -> float:
    return float(np.clip(value, -np.log(4), np.log(4)))


class TokenLag:
    """How late the host sees each engine's steps end, learned from first tokens.

    A request sent to an instance with nothing queued starts in the first step that
    begins after it arrives. If the host saw that instance's last step end ``age``
    seconds before sending it, and its decoding steps last ``step``, the request waits
    ``(step - age - lag) mod step``: the lag decides whether it catches the next step or
    waits a whole one more. ``fit`` compares lags by how far from the waits observed they
    put each request (after an offset common to all of them, which takes up the constant
    errors of the rest of the prediction).

    Only a lag above the one assumed shows in these waits. A router that assumes too
    much takes the arrivals just before a step's end for late ones and avoids them, so
    no observation falls where a lower lag would differ; one that assumes too little
    sends requests there, and they wait a step more than it predicted. So the lag used
    is never below ``floor_s`` (the deployment's figure); the smallest lag that explains
    the waits no worse than the best one raises it, "worse" meaning by more than
    ``confidence`` standard errors of the requests' differences (prefill predictions on
    long prompts are off by more than a step's phase, and a few hundred of them would
    otherwise make a lag out of noise); and what was learned decays by ``decay`` at each
    fit, so that a host that became faster is followed back down and the next fit raises
    it again where it is not.
    """

    RESOLUTION_S = 0.00025

    def __init__(
        self,
        floor_s: float,
        *,
        window: int = 256,
        refit_every: int = 64,
        confidence: float = 3.0,
        decay: float = 0.99,
    ) -> None:
        self.floor_s = floor_s
        self.refit_every = refit_every
        self.confidence = confidence
        self.decay = decay
        self._samples = np.zeros((3, window))  # age, step, wait; a ring
        self._seen = 0
        self._learned = 0.0

    @property
    def lag_s(self) -> float:
        return max(self.floor_s, self._learned)

    def observe(self, age_s: float, step_s: float, wait_s: float) -> None:
        """One request sent with nothing queued ahead: how long before sending it the host
        saw the instance's last step end, the instance's decoding step, and how long the
        request waited for its first step (observed TTFT less its predicted prefill)."""
        window = self._samples.shape[1]
        self._samples[:, self._seen % window] = age_s, step_s, wait_s
        self._seen += 1
        if self._seen % self.refit_every == 0:
            self._learned = max(self.fit(), self._learned * self.decay)

    def fit(self) -> float:
        """The smallest lag, below half a step (a whole step's lag would look like none),
        that the waits observed do not show to be worse than the best one."""
        age, step, wait = self._samples[:, : min(self._seen, self._samples.shape[1])]
        lags = np.arange(0.0, 0.5 * float(np.median(step)), self.RESOLUTION_S)
        residual = wait - np.mod(step - age - lags[:, None], step)
        miss = np.abs(residual - np.median(residual, axis=1, keepdims=True))
        worse = miss - miss[np.argmin(miss.sum(axis=1))]
        error = worse.std(axis=1) / np.sqrt(worse.shape[1])
        return float(lags[np.argmax(worse.mean(axis=1) <= self.confidence * error)])
