"""Capacity and KV state per DC, from instance telemetry, KV events and outcomes.

A slice keeps, per instance, its first and its latest telemetry in the slice (the first
for counter differences, the latest for levels), the evictions (KV blocks removed) and
the prefill and decode tokens delivered per model. Slices merge into a window by keeping
the earliest first, the latest latest, and adding the rest.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from schemas.tables import CapacityRow, KvInstanceRow
from schemas.telemetry import InstanceTelemetry

Reading = dict[str, Any]
"""One telemetry event as a dict, with its event time under ``ts``."""


@dataclass
class FleetSlice:
    first: dict[str, Reading] = field(default_factory=dict)
    latest: dict[str, Reading] = field(default_factory=dict)
    evictions: dict[str, int] = field(default_factory=dict)
    delivered: dict[str, list[int]] = field(default_factory=dict)
    """model -> [prefill tokens, decode tokens] of completed requests."""

    def observe(self, telemetry: InstanceTelemetry, ts: float) -> None:
        reading = {"ts": ts, **telemetry.model_dump(mode="json")}
        instance = telemetry.instance_id
        if instance not in self.first or ts < self.first[instance]["ts"]:
            self.first[instance] = reading
        if instance not in self.latest or ts >= self.latest[instance]["ts"]:
            self.latest[instance] = reading

    def evicted(self, instance: str, blocks: int) -> None:
        self.evictions[instance] = self.evictions.get(instance, 0) + blocks

    def deliver(self, model: str, prefill_tokens: int, decode_tokens: int) -> None:
        done = self.delivered.setdefault(model, [0, 0])
        done[0] += prefill_tokens
        done[1] += decode_tokens

    def merge(self, other: FleetSlice) -> None:
        for instance, reading in other.first.items():
            if instance not in self.first or reading["ts"] < self.first[instance]["ts"]:
                self.first[instance] = reading
        for instance, reading in other.latest.items():
            if instance not in self.latest or reading["ts"] >= self.latest[instance]["ts"]:
                self.latest[instance] = reading
        for instance, blocks in other.evictions.items():
            self.evicted(instance, blocks)
        for model, (prefill, decode) in other.delivered.items():
            self.deliver(model, prefill, decode)

    def to_dict(self) -> dict[str, Any]:
        return {
            "first": self.first,
            "latest": self.latest,
            "evictions": self.evictions,
            "delivered": self.delivered,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FleetSlice:
        return cls(
            dict(data["first"]),
            dict(data["latest"]),
            dict(data["evictions"]),
            {m: list(v) for m, v in data["delivered"].items()},
        )

    def capacity_rows(self, seconds: float, now: float) -> tuple[CapacityRow, ...]:
        groups: dict[tuple[str, str], list[Reading]] = defaultdict(list)
        for reading in self.latest.values():
            groups[(reading["model"], reading["model_version"])].append(reading)
        rows = []
        for (model, version), readings in sorted(groups.items()):
            ready = [r for r in readings if r["ready"]]
            total = sum(r["kv_blocks_total"] for r in ready)
            free = sum(r["kv_blocks_total"] - r["kv_blocks_used"] for r in ready)
            prefill, decode = self.delivered.get(model, [0, 0])
            rows.append(
                CapacityRow(
                    model=model,
                    model_version=version,
                    ready_endpoints=len(ready),
                    kv_blocks_total=total,
                    kv_blocks_free=free,
                    queued=sum(r["waiting"] for r in ready),
                    running=sum(r["running"] for r in ready),
                    inflight_tokens=sum(r["inflight_tokens"] for r in ready),
                    prefill_tokens_per_s=prefill / seconds,
                    decode_tokens_per_s=decode / seconds,
                    headroom=free / total if total else 0.0,
                    telemetry_age_s=max(0.0, now - max(r["ts"] for r in readings)),
                )
            )
        return tuple(rows)

    def kv_rows(self, seconds: float) -> tuple[KvInstanceRow, ...]:
        return tuple(
            KvInstanceRow(
                instance_id=instance,
                pressure=_share(latest["kv_blocks_used"], latest["kv_blocks_total"]),
                prefix_hit_rate=_share(*self._hits(instance)),
                evictions_per_s=self.evictions.get(instance, 0) / seconds,
                preemptions_per_s=self._grown(instance, "preemptions") / seconds,
            )
            for instance, latest in sorted(self.latest.items())
        )

    def kv_totals(self, seconds: float) -> dict[str, float]:
        used = sum(r["kv_blocks_used"] for r in self.latest.values())
        total = sum(r["kv_blocks_total"] for r in self.latest.values())
        hits = [self._hits(i) for i in self.latest]
        return {
            "pressure": _share(used, total),
            "prefix_hit_rate": _share(sum(h for h, _ in hits), sum(q for _, q in hits)),
            "evictions_per_s": sum(self.evictions.values()) / seconds,
            "preemptions_per_s": sum(self._grown(i, "preemptions") for i in self.latest) / seconds,
        }

    def _grown(self, instance: str, counter: str) -> int:
        """Growth of a counter over the window (a restart, which resets it, counts 0)."""
        return max(0, int(self.latest[instance][counter] - self.first[instance][counter]))

    def _hits(self, instance: str) -> tuple[int, int]:
        return self._grown(instance, "prefix_cache_hits"), self._grown(
            instance, "prefix_cache_queries"
        )


def _share(part: float, whole: float) -> float:
    return min(1.0, part / whole) if whole > 0 else 0.0
