"""A workload as CSV for other simulators.

Columns: ``request_id, arrival_us, input_tokens, output_tokens, prefix_group,
prefix_tokens, session_id, round, task_class, tenant, region, deadline_s`` (seconds after
its arrival by which the request must finish; empty where it gives none, as only batch
jobs do). Where a workload names its
prefix groups (the synthetic ones), those are written; otherwise ``prefix_tokens`` is the
leading part of the prompt that an earlier request already had (from the block hashes),
and ``prefix_group`` the request that first had its leading block.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

from sim.workload import ENGINE_BLOCK_TOKENS, TraceRequest, reusable_blocks

COLUMNS = (
    "request_id",
    "arrival_us",
    "input_tokens",
    "output_tokens",
    "prefix_group",
    "prefix_tokens",
    "session_id",
    "round",
    "task_class",
    "tenant",
    "region",
    "deadline_s",
)


def export_csv(requests: Sequence[TraceRequest], path: Path) -> None:
    first_with_block: dict[int, str] = {}
    seen: set[int] = set()
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(COLUMNS)
        for r in requests:
            group, shared = r.prefix_group, r.prefix_tokens
            if group is None and r.prefix_blocks:
                group = first_with_block.setdefault(r.prefix_blocks[0], r.request_id)
                shared = reusable_blocks(r.prefix_blocks, seen) * ENGINE_BLOCK_TOKENS
            seen.update(r.prefix_blocks)
            writer.writerow(
                (
                    r.request_id,
                    round(r.arrival_s * 1e6),
                    r.input_tokens,
                    r.output_tokens,
                    group or "",
                    shared,
                    r.session_id or "",
                    r.round,
                    r.task_class.value,
                    r.tenant,
                    r.region,
                    "" if r.deadline_s is None else r.deadline_s,
                )
            )
