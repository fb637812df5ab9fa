from __future__ import annotations

import pytest

from schemas import DEADLETTER_TOPIC, MESSAGES, TOPICS, VersionedSnapshot, topic, topic_for
from schemas.lifecycle import RequestArrived


def test_names_and_schema_refs_are_unique() -> None:
    names = [t.name for t in TOPICS]
    assert len(names) == len(set(names))
    carried = [m for t in TOPICS for m in t.messages]
    assert len(carried) == len(set(carried)) == len(MESSAGES)


@pytest.mark.parametrize("t", TOPICS, ids=lambda t: t.name)
def test_every_carried_message_has_the_topic_key(t) -> None:
    for message in t.messages:
        assert t.key_field in message.model_fields, f"{message.__name__} lacks {t.key_field}"


@pytest.mark.parametrize("t", TOPICS, ids=lambda t: t.name)
def test_compacted_topics_carry_versioned_snapshots_and_keep_them(t) -> None:
    snapshots = all(issubclass(m, VersionedSnapshot) for m in t.messages)
    assert t.compacted == snapshots
    assert (t.retention_ms is None) == t.compacted
    assert t.partitions >= 1
    config = t.broker_config()
    assert config["cleanup.policy"] == ("compact" if t.compacted else "delete")
    if t.compacted:  # compacted within minutes, not after Kafka's default week
        assert int(config["segment.ms"]) <= 60 * 60 * 1000


def test_the_design_topics_exist() -> None:
    for name in (
        "tf.requests",
        "tf.completions",
        "tf.cancellations",
        "tf.telemetry",
        "tf.kv-events",
        "tf.tables.capacity",
        "tf.tables.kv",
        "tf.tables.goodput",
        "tf.control.quotas",
        "tf.control.weights",
        "tf.control.placement",
        DEADLETTER_TOPIC,
    ):
        assert topic(name).name == name


def test_lookups_explain_what_is_unknown() -> None:
    assert topic_for(RequestArrived).name == "tf.requests"
    with pytest.raises(KeyError, match=r"unknown topic 'tf\.nope'"):
        topic("tf.nope")
