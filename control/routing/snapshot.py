"""What a router sees: one immutable snapshot of the candidate instances, and the request.

The snapshot is a structure of arrays (one row per instance) so that policies can score
every candidate at once with numpy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from control.step_time import StepTime
from control.tokens import BLOCK_TOKENS

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

_UNKNOWN: FloatArray = np.empty(0)
_UNKNOWN_INTS: IntArray = np.empty(0, dtype=np.int64)
"""The defaults of a snapshot's optional arrays, replaced by their neutral values."""

DEFAULT_BLOCK_SIZE = 16
"""Tokens per KV block where the engines are not known: vLLM's default ``--block-size``
on CUDA."""

KvEvent = tuple[int, bool]
"""One KV event of an engine: a block hash, and whether the block was stored (True) or
removed (False)."""


SNAPSHOT_ARRAYS = (
    "ready",
    "waiting",
    "running",
    "inflight_tokens",
    "kv_blocks_used",
    "kv_blocks_total",
    "pending_prefill_tokens",
    "last_step_end_s",
    "kv_block_size",
)
"""``FleetSnapshot``'s per-instance arrays, in field order."""


@dataclass(frozen=True)
class FleetSnapshot:
    """Instance state as a router knows it. Arrays are read-only, aligned with
    ``instance_ids``. ``waiting``, ``running`` and ``kv_blocks_used`` come from the engines'
    metrics as last scraped; ``inflight_tokens`` from the router side's own accounting."""

    instance_ids: tuple[str, ...]
    ready: BoolArray
    waiting: IntArray
    running: IntArray
    inflight_tokens: IntArray
    """Prompt plus output budget of the requests routed there and not yet completed."""
    kv_blocks_used: IntArray
    kv_blocks_total: IntArray
    pending_prefill_tokens: FloatArray = field(default_factory=lambda: _UNKNOWN)
    """Uncached prompt tokens routed there whose first token has not come back yet, as the
    hosts' shared accounting knows them (all gateways together). Not given (zeros) where
    the host does not track first tokens; routers then rely on their own estimates."""
    last_step_end_s: FloatArray = field(default_factory=lambda: _UNKNOWN)
    """When each instance last ended a step that streamed tokens, as the host saw them
    come back (an engine streams every sequence's new token at each step's end): so the
    step in flight began then. Not given (-inf): not known."""
    kv_block_size: IntArray = field(default_factory=lambda: _UNKNOWN_INTS)
    """Tokens per KV block of each instance's engine, as its metrics state it (vLLM's
    ``cache_config_info``): what turns tokens into the blocks ``kv_blocks_*`` count.
    Engines need not take vLLM's default: FlashMLA's kernels for DeepSeek's attention
    page KV in blocks of 64 (deepseek-ai/FlashMLA's README). Not given:
    ``DEFAULT_BLOCK_SIZE``."""

    def __post_init__(self) -> None:
        size = len(self.instance_ids)
        if self.pending_prefill_tokens is _UNKNOWN:
            object.__setattr__(self, "pending_prefill_tokens", np.zeros(size))
        if self.last_step_end_s is _UNKNOWN:
            object.__setattr__(self, "last_step_end_s", np.full(size, -np.inf))
        if self.kv_block_size is _UNKNOWN_INTS:
            object.__setattr__(self, "kv_block_size", np.full(size, DEFAULT_BLOCK_SIZE))
        for name in SNAPSHOT_ARRAYS:
            array = getattr(self, name)
            if array.shape != (size,):
                raise ValueError(f"{name} has shape {array.shape}, expected ({size},)")
            array.flags.writeable = False

    def __len__(self) -> int:
        return len(self.instance_ids)

    @property
    def requests(self) -> IntArray:
        return self.waiting + self.running

    @property
    def kv_tokens_used(self) -> IntArray:
        """Each instance's KV in use, in tokens: its blocks in its engine's size."""
        return self.kv_blocks_used * self.kv_block_size

    @property
    def kv_tokens_total(self) -> IntArray:
        """Each instance's KV cache, in tokens."""
        return self.kv_blocks_total * self.kv_block_size

    def prefix_capacity(self, row: int) -> int:
        """How many prefix blocks (``BLOCK_TOKENS`` each) instance ``row``'s KV holds: the
        size of its entry in a prefix index, whatever its engine's own block size."""
        return prefix_blocks_held(int(self.kv_blocks_total[row]), int(self.kv_block_size[row]))


def prefix_blocks_held(kv_blocks: int, block_size: int) -> int:
    """How many prefix blocks of ``BLOCK_TOKENS`` tokens ``kv_blocks`` blocks of
    ``block_size`` tokens hold."""
    return kv_blocks * block_size // BLOCK_TOKENS


@dataclass(frozen=True, slots=True)
class RouteRequest:
    request_id: str
    input_tokens: int
    output_budget: int | None
    """The client's cap on output tokens (``max_tokens``), None where it set none: what a
    gateway knows of a request's length, never the length itself."""
    prefix_blocks: tuple[int, ...] = ()
    """The hashes of the prompt's leading whole blocks of ``BLOCK_TOKENS`` (16) tokens
    (``control.tokens``): the unit of every prefix index, whatever the engines' own KV
    block size."""
    task_class: str = "interactive"
    known_matches: IntArray | None = None
    """Leading blocks of ``prefix_blocks`` each instance holds, from an index the host keeps
    (the gateways share one); None: a cache-aware router consults its own index."""


@dataclass(frozen=True)
class PoolModel:
    """What a router may know of the model pool: its step times and engine limits."""

    step_time: StepTime
    max_num_batched_tokens: int = 8192
    max_num_seqs: int | None = None
    """Sequences an engine runs at once (vLLM's ``--max-num-seqs``; None: not known).
    vLLM's API server takes 256 unless told, and 1,024 on GPUs of 70 GiB or more other than
    the A100 (``EngineArgs.get_batch_defaults``, vllm/engine/arg_utils.py), so a gateway
    knows it only from the fleet file; the simulator's engines run 256."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """One instance's part in a decision: its score (lower is better) and the terms."""

    instance_id: str
    score: float
    parts: tuple[tuple[str, float], ...] = ()


CACHED_TOKENS = "cached_tokens"
PREDICTED_TTFT_S = "predicted_ttft_s"
"""The terms of a decision record that hosts read (``Decision.cached_tokens`` and
``Decision.predicted_ttft_s``): a router that estimates them names them so."""


@dataclass(frozen=True, slots=True)
class TtftPrediction:
    """A router's answer to admission (``PredictsTtft``): the time to first token a client
    would see for a request, the API's overhead included."""

    on_each: FloatArray
    """On each instance as it is loaded now (infinite where not ready)."""
    idle_s: float
    """On the best ready instance were it idle, its cache as it is: the request's own
    prefill, which no wait shortens (infinite where none is ready)."""


@dataclass(frozen=True)
class Decision:
    """A routing decision with its reasons, kept as arrays aligned with the snapshot.

    ``scores`` is lower-is-better, NaN for instances that were not eligible. ``chosen`` is
    the row of the chosen instance, or None when nothing was eligible.
    """

    policy: str
    chosen: int | None
    scores: FloatArray
    parts: Mapping[str, FloatArray] = field(default_factory=dict)

    @property
    def cached_tokens(self) -> FloatArray | None:
        """Prompt tokens the router expects each candidate to hold cached, if it says."""
        return self.parts.get(CACHED_TOKENS)

    @property
    def predicted_ttft_s(self) -> FloatArray | None:
        """The router's time to first token on each candidate, if it predicts one."""
        return self.parts.get(PREDICTED_TTFT_S)

    def ranked(self) -> list[int]:
        """Rows of the scored instances, best first; the chosen row leads."""
        rows = np.flatnonzero(~np.isnan(self.scores))
        order = sorted(rows.tolist(), key=lambda row: (row != self.chosen, self.scores[row]))
        return order

    def candidates(self, fleet: FleetSnapshot) -> tuple[Candidate, ...]:
        """The eligible candidates, for the decision record."""
        rows = np.flatnonzero(~np.isnan(self.scores))
        return tuple(
            Candidate(
                fleet.instance_ids[row],
                float(self.scores[row]),
                tuple((name, float(values[row])) for name, values in self.parts.items()),
            )
            for row in rows
        )


@dataclass(frozen=True, slots=True)
class Observation:
    """What the host learned about a routed request, for routers that learn online."""

    request_id: str
    instance: int
    ttft_s: float
    output_tokens: int
