"""The common base of every message and the types messages share."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, ClassVar

from pydantic import BaseModel, ConfigDict, Field

NonNegInt = Annotated[int, Field(ge=0)]
NonNegFloat = Annotated[float, Field(ge=0.0)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
Identifier = Annotated[str, Field(min_length=1, max_length=256)]
BlockHash = Annotated[int, Field(ge=-(2**63), lt=2**64)]
"""A KV block hash as engines publish it: a 64-bit integer (signed or unsigned)."""


class TaskClass(StrEnum):
    """Service classes with their own objectives (see DESIGN.md, Measures)."""

    INTERACTIVE = "interactive"
    LONG_DOCUMENT = "long_document"
    BATCH = "batch"


class Frozen(BaseModel):
    """An immutable model that rejects unknown fields and non-finite numbers."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class Message(Frozen):
    """A payload that travels inside an envelope.

    Every concrete message declares its schema name and version as class variables; the
    pair, written ``name/version``, is what the envelope carries and what the catalog
    resolves. A change that breaks old readers gets a new version number.
    """

    schema_name: ClassVar[str]
    schema_version: ClassVar[int] = 1

    @classmethod
    def schema_ref(cls) -> str:
        return f"{cls.schema_name}/{cls.schema_version}"


class VersionedSnapshot(Message):
    """A whole snapshot published under a key: tables and control messages.

    Readers keep the latest value per key and apply a snapshot only when its ``version``
    is greater than the one they hold, so replays and duplicates are harmless.
    """

    version: int = Field(ge=1, description="Monotonically increasing per key.")

    def supersedes(self, current: VersionedSnapshot | None) -> bool:
        """Whether a reader holding ``current`` should replace it with this snapshot."""
        return current is None or self.version > current.version
