"""What instances report: their state (telemetry) and changes of their KV cache (KV events).

Both are keyed by ``instance_id``. KV events mirror the events vLLM publishes with
``--kv-events-config`` (BlockStored, BlockRemoved, AllBlocksCleared).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from schemas.base import BlockHash, Identifier, Message, NonNegInt


class InstanceTelemetry(Message):
    """A point-in-time view of one inference instance, as scraped or simulated."""

    schema_name = "tf.instance.telemetry"

    instance_id: Identifier
    dc: Identifier
    model: Identifier
    model_version: Identifier
    ready: bool
    waiting: NonNegInt
    running: NonNegInt
    inflight_tokens: NonNegInt = Field(description="Prompt and budgeted output tokens in flight.")
    kv_blocks_used: NonNegInt
    kv_blocks_total: NonNegInt
    block_size: int = Field(default=16, ge=1)
    prefix_cache_hits: NonNegInt = Field(default=0, description="Counter of hit tokens.")
    prefix_cache_queries: NonNegInt = Field(default=0, description="Counter of queried tokens.")
    preemptions: NonNegInt = Field(default=0, description="Counter of preempted sequences.")

    @model_validator(mode="after")
    def _consistent(self) -> InstanceTelemetry:
        if self.kv_blocks_used > self.kv_blocks_total:
            raise ValueError(
                f"kv_blocks_used ({self.kv_blocks_used}) exceeds "
                f"kv_blocks_total ({self.kv_blocks_total})"
            )
        if self.prefix_cache_hits > self.prefix_cache_queries:
            raise ValueError("prefix_cache_hits exceeds prefix_cache_queries")
        return self


class KvBlocksStored(Message):
    schema_name = "tf.kv.blocks-stored"

    instance_id: Identifier
    block_hashes: tuple[BlockHash, ...] = Field(min_length=1)
    parent_block_hash: BlockHash | None = Field(
        default=None, description="The block these extend; None for a prompt's first block."
    )
    block_size: int = Field(default=16, ge=1)


class KvBlocksRemoved(Message):
    schema_name = "tf.kv.blocks-removed"

    instance_id: Identifier
    block_hashes: tuple[BlockHash, ...] = Field(min_length=1)


class KvAllCleared(Message):
    schema_name = "tf.kv.all-cleared"

    instance_id: Identifier
    reason: str = ""
