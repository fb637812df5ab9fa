"""The engine's wait queue, in the two orders vLLM's ``--scheduling-policy`` offers.

- ``fcfs`` (vLLM's default): arrival order; a preempted sequence goes back to the head.
- ``priority``: by (priority, arrival at the engine), lower first; a preempted sequence
  takes its place by the same key (vLLM v1's ``PriorityRequestQueue``).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from itertools import count
from typing import TYPE_CHECKING, Protocol

from control.admission.registry import EngineScheduling

if TYPE_CHECKING:
    from sim.engine import Sequence


class WaitQueue(Protocol):
    def add(self, sequence: Sequence) -> None: ...

    def put_back(self, sequence: Sequence) -> None:
        """A preempted sequence returns to the queue."""
        ...

    def peek(self) -> Sequence: ...

    def pop(self) -> Sequence: ...

    def remove(self, sequence: Sequence) -> None: ...

    def __len__(self) -> int: ...

    def __contains__(self, sequence: object) -> bool: ...

    def __iter__(self) -> Iterator[Sequence]: ...


class FcfsQueue:
    def __init__(self) -> None:
        self._queue: deque[Sequence] = deque()

    def add(self, sequence: Sequence) -> None:
        self._queue.append(sequence)

    def put_back(self, sequence: Sequence) -> None:
        self._queue.appendleft(sequence)

    def peek(self) -> Sequence:
        return self._queue[0]

    def pop(self) -> Sequence:
        return self._queue.popleft()

    def remove(self, sequence: Sequence) -> None:
        self._queue.remove(sequence)

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, sequence: object) -> bool:
        return sequence in self._queue

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._queue)


class PriorityQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Sequence]] = []
        self._order = count()

    def add(self, sequence: Sequence) -> None:
        entry = (sequence.priority, sequence.enqueued_s, next(self._order), sequence)
        heapq.heappush(self._heap, entry)

    put_back = add

    def peek(self) -> Sequence:
        return self._heap[0][3]

    def pop(self) -> Sequence:
        return heapq.heappop(self._heap)[3]

    def remove(self, sequence: Sequence) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not sequence]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, sequence: object) -> bool:
        return any(entry[3] is sequence for entry in self._heap)

    def __iter__(self) -> Iterator[Sequence]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))


def wait_queue(policy: EngineScheduling) -> WaitQueue:
    return PriorityQueue() if policy == "priority" else FcfsQueue()
