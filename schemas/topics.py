"""The topic catalog: the one place that says which message travels where, under which key.

The set of known messages is derived from this table, so a message exists for the codec
exactly when it has a topic.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.audit import JournalRecord
from schemas.base import Message
from schemas.control import AdmissionQuotas, PlacementRecommendation, RoutingWeights
from schemas.deadletter import DeadLetter
from schemas.lifecycle import (
    FirstToken,
    RequestAdmitted,
    RequestArrived,
    RequestCancelled,
    RequestCompleted,
    RequestFailed,
    RequestQueued,
    RequestRejected,
    RequestRetried,
    RequestRouted,
)
from schemas.tables import CapacityTable, GoodputTable, KvTable
from schemas.telemetry import InstanceTelemetry, KvAllCleared, KvBlocksRemoved, KvBlocksStored

DAY_MS = 24 * 3600 * 1000
COMPACTED_SEGMENT_MS = 10 * 60 * 1000
"""A compacted topic closes a segment every 10 minutes, which the cleaner then compacts."""


@dataclass(frozen=True)
class Topic:
    """A Kafka topic and the messages it carries.

    ``key_field`` names the payload field every carried message has and that becomes the
    record key. Compacted topics keep the latest value per key forever (``retention_ms``
    is None); the others are deleted after ``retention_ms``.
    """

    name: str
    key_field: str
    partitions: int
    compacted: bool
    retention_ms: int | None
    messages: tuple[type[Message], ...]

    def key_of(self, payload: Message) -> str:
        return str(getattr(payload, self.key_field))

    def broker_config(self) -> dict[str, str]:
        """Topic-level settings for the broker, as ``kafka-topics --config`` takes them."""
        if self.compacted:
            # A segment is compacted only once closed: at Kafka's default (7 days), every
            # table published for a week stays for readers to go through (``status``, a
            # restarted gateway), about 300,000 per DC at one every 2 s.
            return {
                "cleanup.policy": "compact",
                "min.compaction.lag.ms": "0",
                "segment.ms": str(COMPACTED_SEGMENT_MS),
            }
        return {"cleanup.policy": "delete", "retention.ms": str(self.retention_ms)}


TOPICS: tuple[Topic, ...] = (
    Topic(
        "tf.requests",
        "request_id",
        6,
        False,
        7 * DAY_MS,
        (
            RequestArrived,
            RequestAdmitted,
            RequestQueued,
            RequestRejected,
            RequestRouted,
            FirstToken,
            RequestRetried,
        ),
    ),
    Topic("tf.completions", "request_id", 6, False, 7 * DAY_MS, (RequestCompleted, RequestFailed)),
    Topic("tf.cancellations", "request_id", 6, False, 7 * DAY_MS, (RequestCancelled,)),
    Topic("tf.telemetry", "instance_id", 3, False, 1 * DAY_MS, (InstanceTelemetry,)),
    Topic(
        "tf.kv-events",
        "instance_id",
        3,
        False,
        1 * DAY_MS,
        (KvBlocksStored, KvBlocksRemoved, KvAllCleared),
    ),
    Topic("tf.tables.capacity", "dc", 1, True, None, (CapacityTable,)),
    Topic("tf.tables.kv", "dc", 1, True, None, (KvTable,)),
    Topic("tf.tables.goodput", "dc", 1, True, None, (GoodputTable,)),
    Topic("tf.control.quotas", "scope", 1, True, None, (AdmissionQuotas,)),
    Topic("tf.control.weights", "scope", 1, True, None, (RoutingWeights,)),
    Topic("tf.control.placement", "scope", 1, True, None, (PlacementRecommendation,)),
    Topic("tf.deadletter", "source_topic", 1, False, 14 * DAY_MS, (DeadLetter,)),
    Topic("tf.audit.journal", "journal", 3, False, 7 * DAY_MS, (JournalRecord,)),
)

JOURNAL_TOPIC = "tf.audit.journal"

DEADLETTER_TOPIC = "tf.deadletter"

_BY_NAME = {t.name: t for t in TOPICS}
_BY_MESSAGE = {m: t for t in TOPICS for m in t.messages}
MESSAGES: dict[str, type[Message]] = {m.schema_ref(): m for m in _BY_MESSAGE}
"""Every known message by its ``name/version`` reference."""


def topic(name: str) -> Topic:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown topic {name!r}; known: {sorted(_BY_NAME)}") from None


def topic_for(message: type[Message]) -> Topic:
    """The topic a message type travels on."""
    try:
        return _BY_MESSAGE[message]
    except KeyError:
        raise KeyError(f"{message.__name__} travels on no topic") from None
