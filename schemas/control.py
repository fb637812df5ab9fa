"""Control messages the controllers publish and the gateways apply.

Each is a versioned snapshot for one scope (a DC, or an edge region), valid for ``ttl_s``
after ``issued_at``; a gateway that hears nothing newer falls back to documented safe
defaults once the TTL has passed.
"""

from __future__ import annotations

import math

from pydantic import Field, model_validator

from schemas.base import (
    Fraction,
    Frozen,
    Identifier,
    NonNegFloat,
    NonNegInt,
    TaskClass,
    VersionedSnapshot,
)


class ControlSnapshot(VersionedSnapshot):
    scope: Identifier = Field(description="The DC or edge region the snapshot applies to.")
    issued_at: float = Field(description="Epoch seconds.")
    ttl_s: float = Field(gt=0.0)

    def expired(self, now: float) -> bool:
        return now > self.issued_at + self.ttl_s

    def replaces(self, held: ControlSnapshot | None, now: float) -> bool:
        """Whether a reader holding ``held`` for this scope takes this snapshot: a live
        one, newer than ``held`` or where ``held`` has expired (a controller started
        again on a new topic counts its versions from 1 again). Never an expired one: a
        replay of old snapshots must not displace a live one."""
        if self.expired(now):
            return False
        return held is None or held.expired(now) or self.supersedes(held)


class ClassQuota(Frozen):
    task_class: TaskClass
    tenant: Identifier | None = Field(default=None, description="None: the whole class.")
    tokens_per_s: NonNegFloat | None = Field(
        default=None, description="Refill rate of the admission token bucket (None: no bucket)."
    )
    burst_tokens: NonNegInt | None = Field(
        default=None, description="The bucket's size (None: no bucket)."
    )
    max_concurrency: NonNegInt | None = Field(
        default=None, description="Requests of the class in flight at once (None: no limit)."
    )
    for_instances: int | None = Field(
        default=None,
        ge=1,
        description=(
            "The ready instances max_concurrency was set for: a pool with another number "
            "ready runs it in proportion to its own, rounded up (None: the limit is the "
            "same whatever the pool's size)."
        ),
    )
    reserved_share: Fraction | None = Field(
        default=None,
        # Left off the wire when unset: readers from before it could be unset take the
        # missing field as their 0.0, as they read every quota without a reserve before.
        exclude_if=lambda share: share is None,
        description=(
            "Share of capacity held back for this class alone (None: the admission "
            "policy's own default)."
        ),
    )

    @model_validator(mode="after")
    def _sized_limit(self) -> ClassQuota:
        if self.for_instances is not None and self.max_concurrency is None:
            raise ValueError("for_instances sizes a max_concurrency, and there is none")
        return self

    def concurrency(self, ready: int) -> int | None:
        """The requests of the class a pool with ``ready`` instances runs at once (None:
        no limit)."""
        limit = self.max_concurrency
        if limit is None or self.for_instances is None:
            return limit
        return math.ceil(limit * ready / self.for_instances - 1e-9)


class AdmissionQuotas(ControlSnapshot):
    schema_name = "tf.control.quotas"

    quotas: tuple[ClassQuota, ...]

    @model_validator(mode="after")
    def _reservations_fit(self) -> AdmissionQuotas:
        reserved = sum(q.reserved_share or 0.0 for q in self.quotas)
        if reserved > 1.0 + 1e-9:
            raise ValueError(f"reserved shares add up to {reserved:.3f}, more than 1")
        return self


class DcWeight(Frozen):
    model: Identifier
    dc: Identifier
    weight: Fraction = Field(
        description="The share of the DC's capacity the edge counts on (1: all of it; 0: "
        "none, the DC comes last): a DC counted past its capacity would draw traffic it "
        "cannot serve."
    )
    task_class: TaskClass | None = Field(
        default=None,
        description="The class the weight is for (None: every class without one of its own).",
    )


class RoutingWeights(ControlSnapshot):
    schema_name = "tf.control.weights"

    weights: tuple[DcWeight, ...]


class PlacementAction(Frozen):
    model: Identifier
    model_version: Identifier
    dc: Identifier
    target_replicas: NonNegInt
    reason: str = ""


class PlacementRecommendation(ControlSnapshot):
    schema_name = "tf.control.placement"

    actions: tuple[PlacementAction, ...]
