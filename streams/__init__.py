"""The event bus (in-memory and Kafka), and later the table logic and stream processors."""

from streams.bus import EventBus, RawRecord, Received, StartFrom, Subscription
from streams.memory import InMemoryBus

__all__ = ["EventBus", "InMemoryBus", "RawRecord", "Received", "StartFrom", "Subscription"]
