"""The gateways' decision journals, for auditors."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from schemas.base import Identifier, Message


class JournalRecord(Message):
    """One record of a gateway's decision journal: a call its pipeline of one pool made
    (an arrival with the snapshot it was decided on, a release pass, a first token, an
    end, ...) or one choice of DC, with its inputs and results; ``tokenfleet audit``
    replays them. The record's own format is ``control/journal/``'s; its floats are
    finite (infinities and NaN are written as strings)."""

    schema_name = "tf.audit.journal"

    journal: Identifier = Field(
        description="The journal: the gateway, then the pool (``model@dc``) or "
        "``dc-choices``, then the gateway's run; records of one journal share a key."
    )
    record: dict[str, Any] = Field(description="The call: ``seq``, ``call`` and its fields.")
