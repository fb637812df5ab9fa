"""How clients behave when service is slow or refused, so that failure costs something.

A client whose first token has not come within its patience cancels: the engine drops the
request, and the work done for it is wasted. A batch client gives up at its deadline,
finished or not. After a cancel or a rejection, a share of clients try once more (a
repeated execution), after the ``Retry-After`` they were told or ``retry_delay_s``.

The defaults are assumptions, not measurements (no public trace records abandonment):
a person waits a few times the interactive objective (2 s) for a chat to start, longer
for a long document they submitted on purpose; half of them try again once.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

from schemas.base import TaskClass
from sim.workload import TraceRequest

RETRY_SUFFIX = "/retry"
"""Appended to a request's id for its second attempt (which never retries again)."""


@dataclass(frozen=True)
class ClientModel:
    interactive_patience_s: float | None = 10.0
    """How long an interactive client waits for its first token (None: as long as it takes)."""
    long_document_patience_s: float | None = 60.0
    """The same for a long document; batch clients wait for their deadline instead."""
    retry_share: float = 0.5
    retry_delay_s: float = 1.0
    seed: int = 0

    def gives_up_at(self, request: TraceRequest) -> tuple[float, bool] | None:
        """When the client gives up on ``request``, and whether only a first token by then
        would have kept it (else only the whole answer); None: it never gives up."""
        if request.deadline_s is not None:
            return request.arrival_s + request.deadline_s, False
        patience = self.patience_s().get(request.task_class)
        return None if patience is None else (request.arrival_s + patience, True)

    def patience_s(self) -> dict[TaskClass, float]:
        """Each class's patience for a first token, where it has one."""
        return {
            task_class: patience
            for task_class, patience in (
                (TaskClass.INTERACTIVE, self.interactive_patience_s),
                (TaskClass.LONG_DOCUMENT, self.long_document_patience_s),
            )
            if patience is not None
        }

    def retry(
        self, request: TraceRequest, at_s: float, delay_s: float | None
    ) -> TraceRequest | None:
        """The client's second attempt after a cancel or a rejection at ``at_s``, if this
        client makes one (decided by a hash of the request's id, so runs agree)."""
        if request.request_id.endswith(RETRY_SUFFIX) or not self._retries(request.request_id):
            return None
        arrival = at_s + (self.retry_delay_s if delay_s is None else delay_s)
        deadline = request.deadline_s
        if deadline is not None:
            deadline = request.arrival_s + deadline - arrival  # the same moment, from now
            if deadline <= 0:
                return None
        return replace(
            request,
            request_id=request.request_id + RETRY_SUFFIX,
            arrival_s=arrival,
            deadline_s=deadline,
        )

    def _retries(self, request_id: str) -> bool:
        digest = hashlib.blake2b(f"{self.seed}:{request_id}".encode(), digest_size=8).digest()
        return int.from_bytes(digest) / 2**64 < self.retry_share
