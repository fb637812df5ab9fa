"""Request lifecycle: from arrival at a gateway to completion, cancellation or failure.

All lifecycle messages are keyed by ``request_id``, so the events of one request stay in
order on one partition.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from schemas.base import (
    BlockHash,
    Frozen,
    Identifier,
    Message,
    NonNegFloat,
    NonNegInt,
    TaskClass,
)


class RequestArrived(Message):
    """A request reached a gateway; what the policies know of it before any decision."""

    schema_name = "tf.request.arrived"

    request_id: Identifier
    tenant: Identifier
    task_class: TaskClass
    model: Identifier
    input_tokens: NonNegInt
    output_budget: int = Field(
        ge=0,
        description="max_tokens, all choices together: a cap, not the expected length; "
        "0 for a request that generates nothing (embeddings).",
    )
    prefix_blocks: tuple[BlockHash, ...] = Field(
        default=(), description="Chained hashes of the prompt's full KV blocks, in order."
    )
    source_region: Identifier
    residency: tuple[Identifier, ...] = Field(
        default=(), description="Regions allowed to execute the request; empty means any."
    )
    deadline_s: NonNegFloat | None = Field(
        default=None, description="Seconds after arrival by which a batch request must finish."
    )


class RequestAdmitted(Message):
    schema_name = "tf.request.admitted"

    request_id: Identifier
    queue: Identifier = Field(description="The class pool the request was admitted into.")


class RequestQueued(Message):
    schema_name = "tf.request.queued"

    request_id: Identifier
    queue: Identifier
    position: NonNegInt


class RejectReason(StrEnum):
    QUOTA = "quota"
    NO_CAPACITY = "no_capacity"
    DEADLINE = "deadline"
    RESIDENCY = "residency"
    INVALID = "invalid"


class RequestRejected(Message):
    schema_name = "tf.request.rejected"

    request_id: Identifier
    reason: RejectReason
    detail: str = ""
    retry_after_s: NonNegFloat | None = None
    dc: Identifier | None = Field(
        default=None,
        description="The DC whose admission refused the request (the goodput tables count "
        "it there as a failure); none where it was refused before any DC took it: the "
        "tenant's quota at the door, or no DC may run it.",
    )


class CandidateScore(Frozen):
    """One candidate of a routing decision: its score and the parts that made it."""

    instance_id: Identifier
    score: float
    parts: dict[str, float] = Field(
        default_factory=dict, description="Named terms of the score, e.g. queue_s, prefill_s."
    )


class RequestRouted(Message):
    schema_name = "tf.request.routed"

    request_id: Identifier
    dc: Identifier
    instance_id: Identifier
    policy: Identifier
    candidates: tuple[CandidateScore, ...] = Field(
        description="Every candidate considered, the chosen one included."
    )


class FirstToken(Message):
    schema_name = "tf.request.first-token"

    request_id: Identifier
    instance_id: Identifier
    ttft_s: NonNegFloat


class RequestCompleted(Message):
    schema_name = "tf.request.completed"

    request_id: Identifier
    dc: Identifier
    instance_id: Identifier
    task_class: TaskClass
    tenant: Identifier
    input_tokens: NonNegInt
    cached_tokens: NonNegInt
    output_tokens: NonNegInt
    ttft_s: NonNegFloat
    tpot_s: NonNegFloat
    e2e_s: NonNegFloat
    finish_reason: Identifier = "stop"
    streamed: bool = Field(
        default=True,
        description="False: a whole answer, whose first token no one saw: its ttft_s is "
        "its e2e_s, and its objective is judged on its end (ClassObjective.met).",
    )


class CancelReason(StrEnum):
    CLIENT_DISCONNECT = "client_disconnect"
    TIMEOUT = "timeout"
    DEADLINE = "deadline"


class Attributed(Message):
    """An early end, with what attributes it without a join on the request's other events
    (None in events from before these fields existed)."""

    dc: Identifier | None = Field(default=None, description="Where it was to run, if decided.")
    task_class: TaskClass | None = None
    tenant: Identifier | None = None


class RequestCancelled(Attributed):
    schema_name = "tf.request.cancelled"

    request_id: Identifier
    instance_id: Identifier | None = None
    reason: CancelReason
    output_tokens: NonNegInt = Field(default=0, description="Tokens generated before the end.")


class RequestFailed(Attributed):
    schema_name = "tf.request.failed"

    request_id: Identifier
    instance_id: Identifier | None = None
    error: str
    output_tokens: NonNegInt = 0


class RequestRetried(Message):
    schema_name = "tf.request.retried"

    request_id: Identifier
    attempt: int = Field(ge=2)
    from_instance: Identifier
    to_instance: Identifier
    reason: str
