"""The table worker's Faust parts, where they can be checked without a broker."""

from __future__ import annotations

from typing import Any

import pytest
from faust.transport.consumer import ThreadDelegateConsumer
from faust.types import TP

from streams.faust_parts import RewindingConsumer, WorkerApp


def test_a_worker_that_would_start_a_new_partition_at_its_end_is_refused() -> None:
    """Partitions without a committed offset are rewound to their first record, which is
    right only where the consumer starts them there."""
    app = WorkerApp("latest", broker="kafka://127.0.0.1:1", consumer_auto_offset_reset="latest")
    with pytest.raises(ValueError, match="earliest offset"):
        _ = app.transport


async def test_aiokafka_is_asked_for_the_partitions_active_when_faust_asks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Faust empties its set of active partitions while aiokafka answers on its thread,
    and aiokafka answers an empty set with every partition's records: aiokafka gets a
    copy, which Faust's later changes leave alone."""
    asked: list[set[TP] | None] = []

    async def answer(self: Any, active_partitions: set[TP] | None, _: float) -> dict[TP, Any]:
        asked.append(active_partitions)
        return {}

    monkeypatch.setattr(ThreadDelegateConsumer, "_getmany", answer)
    assert WorkerApp("copy", broker="kafka://127.0.0.1:1").transport.Consumer is RewindingConsumer
    consumer = RewindingConsumer.__new__(RewindingConsumer)  # no thread, no loop: only asked
    active = {TP("tf.requests", 0), TP("tf.requests", 1)}
    await consumer._getmany(active, 1.0)
    active.clear()  # as Faust's pause does, while aiokafka may still be answering
    assert asked == [{TP("tf.requests", 0), TP("tf.requests", 1)}]
