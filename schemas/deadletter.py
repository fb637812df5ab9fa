"""What a consumer could not decode, kept whole with the reason."""

from __future__ import annotations

from schemas.base import Message


class DeadLetter(Message):
    schema_name = "tf.deadletter"

    source_topic: str
    partition: int
    offset: int
    key: str | None
    reason: str
    raw_b64: str
