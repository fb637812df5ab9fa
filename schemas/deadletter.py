"""What a consumer could not decode, kept with the reason: whole, or, for a record too
large for a letter, its start."""

from __future__ import annotations

from pydantic import Field

from schemas.base import Message, NonNegInt


class DeadLetter(Message):
    schema_name = "tf.deadletter"

    source_topic: str
    partition: int
    offset: int
    key: str | None
    reason: str
    raw_b64: str
    raw_size: NonNegInt | None = Field(
        default=None,
        description=(
            "The record's size in bytes where raw_b64 holds only its first bytes (None: "
            "it holds the whole record)."
        ),
    )
