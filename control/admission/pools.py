"""Class pools: where admitted-later requests wait, bounded and ordered by what their class
needs (interactive and long documents by arrival, batch by deadline)."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from control.admission.request import AdmissionRequest
from control.admission.view import EXPIRED, PoolState
from schemas.base import TaskClass

Payload = TypeVar("Payload")

DRAIN_WINDOW_S = 30.0
"""How far back a pool's release rate looks: long enough to span several releases of a
pool that drains slowly, short enough to follow a load change within a minute."""


UNDATED_BATCH_AFTER_S = 1e7
"""How far behind its arrival a batch request without a deadline stands in its pool:
about four months, past any deadline a batch job is given, so that it waits behind every
one with a deadline (and its kind by arrival) rather than ahead of deadlines still to
come. A number rather than a pair, so that replicas compare their pools' heads as they
share them (``PoolLoad.head_key``)."""


STALE_ENTRIES_KEPT = 1024
"""Entries of requests no longer held that a heap may keep beyond twice the held ones
before it is rebuilt without them (``ClassPools._prune``): a rebuild costs one pass."""


def order_key(request: AdmissionRequest) -> float:
    """Where a request stands in its class's pool, lowest first: its arrival; for batch
    work, its deadline, and without one, behind every batch request with one."""
    if request.task_class is not TaskClass.BATCH:
        return request.arrival_s
    if request.deadline_s is None:
        return request.arrival_s + UNDATED_BATCH_AFTER_S
    return request.deadline_s


@dataclass
class Waiting(Generic[Payload]):
    """A held request, what the host needs to dispatch it later, and until when it waits."""

    request: AdmissionRequest
    payload: Payload
    hold_until_s: float
    drains: bool = True
    """Whether its release counts in its pool's drain rate: not for a request held only
    for its host's next slot grant (``SLOT_WAIT``), which tells nothing of how fast the
    pool drains, and would read as a pool that drains one request in its window."""
    waits_alone: bool = False
    """Whether it waits, as last decided, for room of its own that the requests behind
    it do not need (a long prompt held for prefill room in a pool of short ones): its
    host's release passes step past it, so no one should wait behind it (``lead``)."""
    expires_as: str = EXPIRED
    """The reason it is answered with once its hold runs out (``AdmissionDecision``)."""


@dataclass
class ClassPools(Generic[Payload]):
    """Each class's pool is a heap in its own order; a second heap orders every held
    request by its hold's end. An entry taken out of one heap is left in the other and
    skipped there when it comes up (``_live`` says which entries still wait)."""

    _heaps: dict[TaskClass, list[tuple[float, int]]] = field(
        default_factory=lambda: {c: [] for c in TaskClass}
    )
    _ends: list[tuple[float, int]] = field(default_factory=list)
    _live: dict[int, Waiting[Payload]] = field(default_factory=dict)
    _orders: dict[str, int] = field(default_factory=dict)
    """Each held request's entry, by request id."""
    _depth: dict[TaskClass, int] = field(default_factory=lambda: dict.fromkeys(TaskClass, 0))
    _released: dict[TaskClass, deque[float]] = field(
        default_factory=lambda: {c: deque() for c in TaskClass}
    )
    _order: int = 0

    def __len__(self) -> int:
        return len(self._live)

    def hold(self, waiting: Waiting[Payload]) -> None:
        request = waiting.request
        self._order += 1
        self._live[self._order] = waiting
        self._orders[request.request_id] = self._order
        self._depth[request.task_class] += 1
        heapq.heappush(self._heaps[request.task_class], (order_key(request), self._order))
        if waiting.hold_until_s != float("inf"):
            heapq.heappush(self._ends, (waiting.hold_until_s, self._order))

    def head(self, task_class: TaskClass) -> Waiting[Payload] | None:
        heap = self._heaps[task_class]
        while heap and heap[0][1] not in self._live:
            heapq.heappop(heap)
        return self._live[heap[0][1]] if heap else None

    def lead(self, task_class: TaskClass) -> Waiting[Payload] | None:
        """The first held request of ``task_class`` that does not wait alone: the one the
        rest of the pool, on every host that shares it, waits behind. The heads that wait
        alone are popped to find it, and pushed back."""
        heap, passed = self._heaps[task_class], []
        while (head := self.head(task_class)) is not None and head.waits_alone:
            passed.append(heapq.heappop(heap))
        for entry in passed:
            heapq.heappush(heap, entry)
        return head

    def release(self, task_class: TaskClass, now_s: float) -> Waiting[Payload]:
        """Take the head of ``task_class``'s pool out, to dispatch it or answer it."""
        waiting = self.set_aside(task_class)
        if waiting.drains:
            self._released[task_class].append(now_s)
        return waiting

    def set_aside(self, task_class: TaskClass) -> Waiting[Payload]:
        """Take the head of ``task_class``'s pool out without counting it as drained: to
        hold it again (``hold``) once the requests behind it have had their turn."""
        if self.head(task_class) is None:
            raise LookupError(f"the {task_class.value} pool is empty")
        _, order = heapq.heappop(self._heaps[task_class])
        return self._take(order)

    def expired(self, now_s: float) -> Iterator[Waiting[Payload]]:
        """Take out every request whose hold has run out, wherever it stands in its pool."""
        while self._ends and self._ends[0][0] <= now_s:
            _, order = heapq.heappop(self._ends)
            if order in self._live:
                yield self._take(order)

    def take_all(self) -> list[Waiting[Payload]]:
        """Take out every held request, in the order they came."""
        return [self._take(order) for order in sorted(self._live)]

    def withdraw(self, request_id: str) -> Waiting[Payload] | None:
        """Take a held request out wherever it stands (its client went away); None if it
        is not held."""
        order = self._orders.get(request_id)
        return None if order is None else self._take(order)

    def state(self, task_class: TaskClass, now_s: float) -> PoolState:
        released = self._released[task_class]
        while released and released[0] < now_s - DRAIN_WINDOW_S:
            released.popleft()
        return PoolState(self._depth[task_class], len(released) / DRAIN_WINDOW_S)

    def _take(self, order: int) -> Waiting[Payload]:
        waiting = self._live.pop(order)
        del self._orders[waiting.request.request_id]
        self._depth[waiting.request.task_class] -= 1
        self._prune()
        return waiting

    def _prune(self) -> None:
        """Drop the entries of requests no longer held once they are most of a heap: a
        request released or withdrawn leaves its entry in the other heap until it comes
        up there, which for a hold's end may be a batch deadline a day away (50 batch
        requests a second held and released would otherwise keep millions)."""
        for heap in (self._ends, *self._heaps.values()):
            if len(heap) > 2 * len(self._live) + STALE_ENTRIES_KEPT:
                heap[:] = [entry for entry in heap if entry[1] in self._live]
                heapq.heapify(heap)
