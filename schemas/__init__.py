"""Pydantic models of every event and control message, the topic catalog and the codec."""

from schemas.base import Message, TaskClass, VersionedSnapshot
from schemas.envelope import DecodeError, Envelope, decode, encode
from schemas.topics import DEADLETTER_TOPIC, MESSAGES, TOPICS, Topic, topic, topic_for

__all__ = [
    "DEADLETTER_TOPIC",
    "MESSAGES",
    "TOPICS",
    "DecodeError",
    "Envelope",
    "Message",
    "TaskClass",
    "Topic",
    "VersionedSnapshot",
    "decode",
    "encode",
    "topic",
    "topic_for",
]
