"""What replicas side by side tell each other of their class pools (``gateway.admission``):
each one's load per pool and class as the JSON it publishes, and the sum of the others'.

A load is ``{pool: {class: [in flight, decoding, held, drained per s, head, arrived per
s]}}``, where a pool is ``model/dc``, ``head`` is where the replica's first held request
stands in the pool's order, on the wall clock (every replica's monotonic clock starts
elsewhere), leaving out those its passes step past (``ClassLoad.head_key``), and the
last is the rate the replica sends the class into the pool. A replica of an earlier
version publishes no such rate, which reads as none; one from before the rate
(2026-12-06) cannot read this version's loads, and skips them (logged) until it is
upgraded too. Fields past the six are a later version's, read past.
"""

from __future__ import annotations

import json
import logging

from control.pipeline import ClassLoad
from schemas.base import TaskClass

log = logging.getLogger(__name__)


def encoded(loads: dict[TaskClass, ClassLoad], to_wall_s: float) -> dict[str, list[float | None]]:
    """A pipeline's load as JSON, its pool order on the wall clock (every replica's
    monotonic clock starts elsewhere)."""
    return {
        c.value: [
            load.inflight,
            load.decoding,
            load.held,
            load.drained_per_s,
            None if load.head_key is None else load.head_key + to_wall_s,
            load.arrived_per_s,
        ]
        for c, load in loads.items()
    }


def decoded(raw: str, to_own_s: float) -> dict[str, dict[TaskClass, ClassLoad]] | None:
    """A peer's load by pool, its pool order on this replica's clock; None (logged) where
    it is not one this replica reads: a replica of another version, mid-upgrade, must not
    stop this one's pools."""
    try:
        return {
            pool: {
                TaskClass(name): _class_load(fields, to_own_s) for name, fields in classes.items()
            }
            for pool, classes in json.loads(raw).items()
        }
    except (ValueError, TypeError, AttributeError) as exc:
        log.warning("skipping a peer's admission load it cannot read (%s)", exc)
        return None


def _class_load(fields: list[float | None], to_own_s: float) -> ClassLoad:
    """One class's load from its published fields: five from a replica of a version
    before the rate (2026-12-06), six from this one's; any past those are a later
    version's, and ignored. ValueError for fewer than five."""
    if len(fields) < 5:
        raise ValueError(f"a class load of {len(fields)} fields")
    inflight, decoding, held, drained, head, *arrived = fields
    return ClassLoad(
        int(inflight or 0),
        int(decoding or 0),
        int(held or 0),
        float(drained or 0.0),
        None if head is None else head + to_own_s,
        float(arrived[0] or 0.0) if arrived else 0.0,
    )


def summed(peers: list[dict[TaskClass, ClassLoad]]) -> dict[TaskClass, ClassLoad]:
    """The other replicas' loads on one pool, added up class by class."""
    return {c: sum((p.get(c, ClassLoad()) for p in peers), ClassLoad()) for c in TaskClass}
