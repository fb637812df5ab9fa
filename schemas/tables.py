"""Rolling per-DC tables that the stream processors publish and the controllers read.

Each table is a whole snapshot keyed by ``dc``, versioned, and carries the bounds of the
window it summarises.
"""

from __future__ import annotations

import hashlib

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


class WindowedTable(VersionedSnapshot):
    dc: Identifier
    window_start: float = Field(description="Event time (epoch seconds) the window opens.")
    window_end: float

    @model_validator(mode="after")
    def _window_ordered(self) -> WindowedTable:
        if self.window_end < self.window_start:
            raise ValueError(
                f"window_end ({self.window_end}) is before window_start ({self.window_start})"
            )
        return self


class CapacityRow(Frozen):
    model: Identifier
    model_version: Identifier
    ready_endpoints: NonNegInt
    kv_blocks_total: NonNegInt
    kv_blocks_free: NonNegInt
    queued: NonNegInt
    running: NonNegInt
    inflight_tokens: NonNegInt
    prefill_tokens_per_s: NonNegFloat
    decode_tokens_per_s: NonNegFloat
    headroom: Fraction = Field(description="Estimated share of capacity still free.")
    telemetry_age_s: NonNegFloat = Field(description="Age of the freshest telemetry.")


class CapacityTable(WindowedTable):
    schema_name = "tf.table.capacity"

    rows: tuple[CapacityRow, ...]


class KvInstanceRow(Frozen):
    instance_id: Identifier
    pressure: Fraction = Field(description="Share of KV blocks in use.")
    prefix_hit_rate: Fraction
    evictions_per_s: NonNegFloat
    preemptions_per_s: NonNegFloat


class KvTable(WindowedTable):
    schema_name = "tf.table.kv"

    pressure: Fraction
    prefix_hit_rate: Fraction
    evictions_per_s: NonNegFloat
    preemptions_per_s: NonNegFloat
    instances: tuple[KvInstanceRow, ...]


class GoodputRow(Frozen):
    """Outcomes of one class, one tenant, one class of one source region, or one model over
    the window."""

    key: Identifier = Field(
        description="A task class, a tenant id, a source region and a task class "
        "(``region/class``), or a model's name."
    )
    completed: NonNegInt
    output_tokens: NonNegInt
    goodput_tokens: NonNegInt = Field(description="Output tokens of requests that met the SLO.")
    output_tokens_per_s: NonNegFloat = Field(
        default=0.0, description="output_tokens over the window's span (window_end - start)."
    )
    goodput_tokens_per_s: NonNegFloat = Field(
        default=0.0, description="goodput_tokens over the window's span: the goodput rate."
    )
    compliance: Fraction
    ttft_p50_s: NonNegFloat
    ttft_p95_s: NonNegFloat
    ttft_p99_s: NonNegFloat
    tpot_p50_s: NonNegFloat
    tpot_p95_s: NonNegFloat
    tpot_p99_s: NonNegFloat
    failures: NonNegInt = Field(
        description="Requests that failed, or that the DC's admission refused: either way "
        "the client got no answer from it."
    )
    cancellations: NonNegInt
    timeouts: NonNegInt
    retries: NonNegInt
    repeated_executions: NonNegInt
    wasted_tokens: NonNegInt
    late_events: NonNegInt = Field(description="Events that arrived after the window's grace.")


REGION_IN_KEY = 200
"""Characters of a region kept in a row's key: with the class, within an identifier's 256."""


def region_row_key(region: str, task_class: TaskClass) -> str:
    """The key of the ``GoodputTable.regions`` row of ``region``'s ``task_class``; a region
    name longer than ``REGION_IN_KEY`` is cut and marked with a digest of the whole."""
    if len(region) > REGION_IN_KEY:
        digest = hashlib.sha256(region.encode()).hexdigest()[:16]
        region = f"{region[: REGION_IN_KEY - 17]}~{digest}"
    return f"{region}/{task_class.value}"


class GoodputTable(WindowedTable):
    schema_name = "tf.table.goodput"

    classes: tuple[GoodputRow, ...]
    tenants: tuple[GoodputRow, ...]
    regions: tuple[GoodputRow, ...] = Field(
        default=(),
        description="Per source region (the region whose edge took the request) and class, "
        "keyed ``region/class``: what the DC delivered to each region's clients, by which "
        "FleetMind weighs the DC for each edge. Empty in tables from before 2026-12-05.",
    )
    models: tuple[GoodputRow, ...] = Field(
        default=(),
        description="Per model, keyed by its name: what the DC completed of each, by which "
        "an edge prices how fast the DC works through a model's queue. Empty in tables from "
        "before 2026-12-06.",
    )

    @model_validator(mode="after")
    def _known_classes(self) -> GoodputTable:
        known = {c.value for c in TaskClass}
        unknown = sorted(row.key for row in self.classes if row.key not in known)
        unknown += sorted(r.key for r in self.regions if r.key.rpartition("/")[2] not in known)
        if unknown:
            raise ValueError(f"unknown task classes in classes or regions: {unknown}")
        return self

    def region_rows(self, region: str) -> dict[TaskClass, GoodputRow]:
        """The rows of ``region``'s requests, by class (only classes it had)."""
        rows = {row.key: row for row in self.regions}
        keys = {c: region_row_key(region, c) for c in TaskClass}
        return {c: rows[key] for c, key in keys.items() if key in rows}
