"""Labels no public trace carries, assigned by fixed rules so every run agrees.

- **Task class**: a prompt of ``LONG_DOCUMENT_TOKENS`` (16,384) or more is ``long_document``
  (the rule admission identifies classes by, ``control.admission.request``); otherwise the
  trace's own kind decides: offline summarisation (arXiv) is ``batch``, everything else
  ``interactive``.
- **Deadline**: batch requests must finish within 600 s of arrival.
- **Tenant**: a trace's own client id where it has one (ServeGen); else one of four
  tenants with shares 40/30/20/10 %, drawn from a hash of the session (or request) id.
- **Region of origin**: ``eu-west``, ``us-east`` or ``ap-south`` with shares 50/30/20 %,
  drawn from a hash of the session (or request) id, so a session stays in one region.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeGuard

from control.admission.request import LONG_DOCUMENT_TOKENS
from schemas.base import TaskClass
from sim.workload import TraceRequest

BATCH_DEADLINE_S = 600.0
TENANTS = (("tenant-a", 0.4), ("tenant-b", 0.3), ("tenant-c", 0.2), ("tenant-d", 0.1))
REGIONS = (("eu-west", 0.5), ("us-east", 0.3), ("ap-south", 0.2))


def label(
    requests: Sequence[TraceRequest], *, batch: bool = False, seed: int = 0
) -> list[TraceRequest]:
    """The requests with class, deadline, tenant and region set by the rules above."""
    return [_labelled(r, batch, seed) for r in requests]


def _labelled(request: TraceRequest, batch: bool, seed: int) -> TraceRequest:
    key = request.session_id or request.request_id
    if request.input_tokens >= LONG_DOCUMENT_TOKENS:
        task_class = TaskClass.LONG_DOCUMENT
    else:
        task_class = TaskClass.BATCH if batch else TaskClass.INTERACTIVE
    tenant = request.tenant if request.tenant != "default" else _pick(TENANTS, key, seed, "t")
    return replace(
        request,
        task_class=task_class,
        deadline_s=BATCH_DEADLINE_S if task_class is TaskClass.BATCH else None,
        tenant=tenant,
        region=_pick(REGIONS, key, seed, "r"),
    )


def _name(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


def finite_number(value: object) -> TypeGuard[int | float]:
    """Whether a JSON value is a finite number (not a boolean, which Python counts as one;
    not the NaN or Infinity Python's JSON reader takes)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _seconds(value: object) -> bool:
    return finite_number(value) and value > 0


_CLASS_VALUES = tuple(c.value for c in TaskClass)
LABEL_RULES: dict[str, tuple[str, Callable[[object], bool]]] = {
    "class": (f"one of {', '.join(_CLASS_VALUES)}", lambda value: value in _CLASS_VALUES),
    "tenant": ("a name", _name),
    "deadline_s": (
        "a number of seconds above 0, or null (none)",
        lambda value: value is None or _seconds(value),
    ),
    "region": ("a name", _name),
}
"""What a row of a labelled trace file may carry, each what it must be (``sim.traces``
checks the rows); the rules above fill in the rest."""
LABEL_COLUMNS = tuple(LABEL_RULES)


def with_given(
    requests: Sequence[TraceRequest], given: Mapping[str, Mapping[str, Any]]
) -> list[TraceRequest]:
    """The labelled ``requests`` with what their rows gave (by request id) in place of the
    rules' choices: a class (a batch request given no deadline gets the batch deadline;
    another class given none has none), a tenant, a deadline in seconds (null: none, a
    batch request's too), a region, each as ``LABEL_RULES`` says."""
    return [_given(r, given[r.request_id]) if given.get(r.request_id) else r for r in requests]


def _given(request: TraceRequest, row: Mapping[str, Any]) -> TraceRequest:
    changes: dict[str, Any] = {}
    if "class" in row:
        changes["task_class"] = TaskClass(row["class"])
        batch = changes["task_class"] is TaskClass.BATCH
        changes["deadline_s"] = BATCH_DEADLINE_S if batch else None
    for column, field in (("tenant", "tenant"), ("deadline_s", "deadline_s"), ("region", "region")):
        if column in row:
            changes[field] = row[column]
    return replace(request, **changes)


def _pick(choices: Sequence[tuple[str, float]], key: str, seed: int, salt: str) -> str:
    digest = hashlib.blake2b(f"{seed}:{salt}:{key}".encode(), digest_size=8).digest()
    point = int.from_bytes(digest) / 2**64
    for name, share in choices:
        if point < share:
            return name
        point -= share
    return choices[-1][0]
