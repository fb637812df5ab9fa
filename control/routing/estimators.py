"""The online estimators TokenPilot keeps: work it has sent, outputs, and its own bias."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

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
        self._events: list[tuple[float, int, bool]] = []  # (time, entry, is the finish)
        self._open: dict[int, tuple[int, float, bool]] = {}  # instance, tokens, decoding
        self._entries = 0

    def add(self, instance: int, tokens: float, first_token_at: float, finish_at: float) -> int:
        """Count a routed request; returns its entry, for ``withdraw``."""
        self._entries += 1
        entry = self._entries
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

    def withdraw(self, entry: int) -> None:
        """Forget an entry whose request did not go where it was counted."""
        if entry in self._open:
            self._retire(entry, finished=True)

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
    completions seen; the output budget is only a cap. Before any completion, half the
    budget."""

    smoothing: float = 0.05

    def __post_init__(self) -> None:
        self._mean: dict[str, float] = {}

    def expected(self, key: str, budget: int) -> float:
        mean = self._mean.get(key)
        return budget / 2 if mean is None else min(mean, float(budget))

    def observe(self, key: str, output_tokens: int) -> None:
        mean = self._mean.get(key)
        self._mean[key] = (
            float(output_tokens)
            if mean is None
            else (mean + self.smoothing * (output_tokens - mean))
        )


class BiasCorrection:
    """Per-instance ratio of observed to predicted TTFT (exponential moving average of the
    log ratio, clipped to [1/4, 4]); predictions are multiplied by it."""

    def __init__(self, instances: int, smoothing: float = 0.1) -> None:
        self._log_ratio = np.zeros(instances, dtype=np.float64)
        self.smoothing = smoothing

    @property
    def ratio(self) -> np.ndarray:
        return np.exp(self._log_ratio)

    def observe(self, instance: int, raw_prediction_s: float, observed_s: float) -> None:
        """Move towards ``observed / raw prediction`` (the prediction before correction)."""
        if raw_prediction_s <= 0 or observed_s <= 0:
            return
        error = np.log(observed_s / raw_prediction_s) - self._log_ratio[instance]
        updated = self._log_ratio[instance] + self.smoothing * error
        self._log_ratio[instance] = float(np.clip(updated, -np.log(4), np.log(4)))
