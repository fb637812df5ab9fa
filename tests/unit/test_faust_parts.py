"""The table worker's Faust parts, where they can be checked without a broker."""

from __future__ import annotations

import pytest

from streams.faust_parts import WorkerApp


def test_a_worker_that_would_start_a_new_partition_at_its_end_is_refused() -> None:
    """Partitions without a committed offset are rewound to their first record, which is
    right only where the consumer starts them there."""
    app = WorkerApp("latest", broker="kafka://127.0.0.1:1", consumer_auto_offset_reset="latest")
    with pytest.raises(ValueError, match="earliest offset"):
        _ = app.transport
