"""How long one engine step takes, and the fixed latencies around it.

Two forms:

- ``KneeRoofline``: ``t = a + b*max(0, P + B - n0) + c*B + d*C + e*A``, with P the prefill
  tokens of the step, B its decode sequences, C their context tokens and A the prefill
  attention pairs (each prefill token times the context it attends to). Below the knee
  ``n0`` a step is bound by reading the weights (cost ``a``); past it, every token adds
  compute. ``ttft_overhead_s`` is the fixed API cost (tokenising, detokenising, HTTP) a
  client sees on top of the engine's time to first token.
- ``Blackbox``: the form of the BLIS simulator (inference-sim, ``sim/latency/latency.go``
  at commit b563c440): ``step = b0 + b1*uncached prefill tokens + b2*decode tokens``, a
  queueing delay ``a0 + a1*input`` before a request enters the wait queue, and ``a2`` per
  output token, reported but not advancing the clock. Coefficients in microseconds, as
  BLIS publishes them, so runs compare with other simulators on identical numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[np.floating[Any]]
Values = Array | npt.NDArray[np.integer[Any]] | float
"""Counts per instance (arrays), or one count."""
Seconds = Array | float
"""Times per instance, or one time: what ``Values`` give."""

US = 1e-6


class StepTime(Protocol):
    @property
    def ttft_overhead_s(self) -> float:
        """Added to each request's time to first token (does not advance the engine clock)."""
        ...

    @property
    def token_overhead_s(self) -> float:
        """Added to each output token's time (does not advance the engine clock)."""
        ...

    def step_s(
        self, prefill_tokens: int, prefill_pairs: int, decode_seqs: int, decode_context: int
    ) -> float:
        """Duration of a step; a step with nothing scheduled is never asked for.

        ``prefill_pairs``: the sum over prefill tokens of the context each attends to.
        """
        ...

    def admission_delay_s(self, input_tokens: int) -> float:
        """Delay from a request's arrival to its entering the engine's wait queue."""
        ...

    def under_load(self, decode_seqs: Values, decode_context: Values) -> StepsUnderLoad:
        """The model bound to each instance's decoding load (numpy arrays, element-wise; a
        scalar stands for the same load everywhere), for routers that time many steps of
        many instances: what the load costs is computed once."""
        ...

    def attention_s(self, prefill_pairs: Values) -> Seconds:
        """What a step's prefill attention over ``prefill_pairs`` adds to it."""
        ...


class StepsUnderLoad(Protocol):
    def step_s(self, prefill_tokens: Values) -> Seconds:
        """Duration of a step that also prefills ``prefill_tokens`` (no attention pairs)."""
        ...

    def decode_step_s(self, more_sequences: int) -> Seconds:
        """Duration of a step with no prefill that decodes ``more_sequences`` sequences
        besides the load (their context not counted)."""
        ...


@dataclass(frozen=True)
class KneeRoofline:
    a_s: float
    b_s_per_token: float
    n0_tokens: float
    c_s_per_seq: float
    d_s_per_context_token: float
    e_s_per_prefill_pair: float = 0.0
    ttft_overhead_s: float = 0.0
    token_overhead_s: float = 0.0

    def step_s(
        self, prefill_tokens: int, prefill_pairs: int, decode_seqs: int, decode_context: int
    ) -> float:
        compute = max(0.0, prefill_tokens + decode_seqs - self.n0_tokens)
        return (
            self.a_s
            + self.b_s_per_token * compute
            + self.c_s_per_seq * decode_seqs
            + self.d_s_per_context_token * decode_context
            + self.e_s_per_prefill_pair * prefill_pairs
        )

    def admission_delay_s(self, input_tokens: int) -> float:
        return 0.0

    def under_load(self, decode_seqs: Values, decode_context: Values) -> _KneeUnderLoad:
        fixed = self.a_s + self.c_s_per_seq * decode_seqs
        return _KneeUnderLoad(
            fixed + self.d_s_per_context_token * decode_context,
            self.n0_tokens - decode_seqs,
            self.b_s_per_token,
            self.c_s_per_seq,
        )

    def attention_s(self, prefill_pairs: Values) -> Seconds:
        return self.e_s_per_prefill_pair * prefill_pairs


@dataclass(frozen=True)
class Blackbox:
    beta0_us: float
    beta1_us: float
    beta2_us: float
    alpha0_us: float
    alpha1_us: float
    alpha2_us: float

    @property
    def ttft_overhead_s(self) -> float:
        return self.alpha2_us * US

    @property
    def token_overhead_s(self) -> float:
        return self.alpha2_us * US

    def step_s(
        self, prefill_tokens: int, prefill_pairs: int, decode_seqs: int, decode_context: int
    ) -> float:
        return (self.beta0_us + self.beta1_us * prefill_tokens + self.beta2_us * decode_seqs) * US

    def admission_delay_s(self, input_tokens: int) -> float:
        return (self.alpha0_us + self.alpha1_us * input_tokens) * US

    def under_load(self, decode_seqs: Values, decode_context: Values) -> _BlackboxUnderLoad:
        return _BlackboxUnderLoad(
            (self.beta0_us + self.beta2_us * decode_seqs) * US,
            self.beta1_us * US,
            self.beta2_us * US,
        )

    def attention_s(self, prefill_pairs: Values) -> Seconds:
        return np.zeros_like(prefill_pairs, dtype=np.float64)


@dataclass(frozen=True, slots=True)
class _KneeUnderLoad:
    fixed_s: Values
    """The step's cost before any prefill token: weights, sequences and their context."""
    free_tokens: Values
    """Prefill tokens the step takes below the knee, bound by reading the weights."""
    s_per_token: float
    s_per_seq: float

    def step_s(self, prefill_tokens: Values) -> Seconds:
        return self.fixed_s + self.s_per_token * np.maximum(prefill_tokens - self.free_tokens, 0.0)

    def decode_step_s(self, more_sequences: int) -> Seconds:
        compute = self.s_per_token * np.maximum(more_sequences - self.free_tokens, 0.0)
        return self.fixed_s + self.s_per_seq * more_sequences + compute


@dataclass(frozen=True, slots=True)
class _BlackboxUnderLoad:
    fixed_s: Values
    s_per_token: float
    s_per_seq: float

    def step_s(self, prefill_tokens: Values) -> Seconds:
        return self.fixed_s + self.s_per_token * prefill_tokens

    def decode_step_s(self, more_sequences: int) -> Seconds:
        return self.fixed_s + self.s_per_seq * more_sequences
