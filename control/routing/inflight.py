"""What a router counts of its own requests in flight, as the upstream routers count it.

SGLang's router (``WorkerLoadGuard``), AIBrix's gateway (``AddRequestCount`` /
``DoneRequestCount``) and Envoy's ``LEAST_REQUEST`` (``rq_active_``) count the requests
they dispatched to each instance and that have not ended: one more at dispatch, one fewer
when the response ends, fresh at every decision, and per router process (replicas do not
share them). Dynamo's KV router tracks more of each request (``ActiveSequences``): its
prefill tokens until the first token comes back, its blocks until it ends. The host tells
a router that follows its requests when each one sends its first token and when it ends
(``registry.FollowsRequests``). The pipeline keeps an ``InFlight`` of its own, for
admission's count of each instance's seats (``AdmissionView.seated``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


class InFlight:
    """Requests dispatched to each instance (a row) and not ended."""

    def __init__(self) -> None:
        self._row: dict[str, int] = {}
        self._counts: IntArray = np.zeros(0, dtype=np.int64)

    def counts(self, instances: int) -> IntArray:
        """The count of each of ``instances`` rows (a pool that grew counts 0 for new rows)."""
        if len(self._counts) < instances:
            self._counts = np.concatenate(
                [self._counts, np.zeros(instances - len(self._counts), dtype=np.int64)]
            )
        return self._counts[:instances].copy()

    def dispatched(self, request_id: str, row: int) -> None:
        self.ended(request_id)  # a request routed again counts once, where it went last
        self.counts(row + 1)
        self._row[request_id] = row
        self._counts[row] += 1

    def ended(self, request_id: str) -> None:
        """Counts the request out; a request not counted (or counted out) is ignored."""
        row = self._row.pop(request_id, None)
        if row is not None:
            self._counts[row] -= 1


@dataclass
class _Active:
    row: int
    prefill_tokens: float
    blocks: float


class ActiveSequences:
    """Dynamo's view of each worker's active requests: prefill tokens still to compute
    (until the first token) and KV blocks held (until the end)."""

    def __init__(self) -> None:
        self._active: dict[str, _Active] = {}
        self._prefill: FloatArray = np.zeros(0)
        self._blocks: FloatArray = np.zeros(0)

    def prefill_tokens(self, instances: int) -> FloatArray:
        self._grow(instances)
        return self._prefill[:instances].copy()

    def blocks(self, instances: int) -> FloatArray:
        self._grow(instances)
        return self._blocks[:instances].copy()

    def add(self, request_id: str, row: int, prefill_tokens: float, blocks: float) -> None:
        self.free(request_id)  # a request routed again counts once, where it went last
        self._grow(row + 1)
        self._active[request_id] = _Active(row, prefill_tokens, blocks)
        self._prefill[row] += prefill_tokens
        self._blocks[row] += blocks

    def prefill_done(self, request_id: str) -> None:
        active = self._active.get(request_id)
        if active is not None:
            self._prefill[active.row] -= active.prefill_tokens
            active.prefill_tokens = 0.0

    def free(self, request_id: str) -> None:
        active = self._active.pop(request_id, None)
        if active is not None:
            self._prefill[active.row] -= active.prefill_tokens
            self._blocks[active.row] -= active.blocks

    def _grow(self, instances: int) -> None:
        if len(self._prefill) < instances:
            more = instances - len(self._prefill)
            self._prefill = np.concatenate([self._prefill, np.zeros(more)])
            self._blocks = np.concatenate([self._blocks, np.zeros(more)])
