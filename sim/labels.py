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
from collections.abc import Sequence
from dataclasses import replace

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


def _pick(choices: Sequence[tuple[str, float]], key: str, seed: int, salt: str) -> str:
    digest = hashlib.blake2b(f"{seed}:{salt}:{key}".encode(), digest_size=8).digest()
    point = int.from_bytes(digest) / 2**64
    for name, share in choices:
        if point < share:
            return name
        point -= share
    return choices[-1][0]
