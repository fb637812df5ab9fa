"""A workload as CSV for other simulators: its columns are ``DESCRIPTION``'s, which
``tokenfleet workload export --help`` shows."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

from sim.workload import ENGINE_BLOCK_TOKENS, TraceRequest, reusable_blocks

DESCRIPTION = (
    "Writes one row a request, in arrival order: request_id, arrival_us (its arrival in "
    "microseconds, on the trace's own clock), input_tokens, output_tokens, prefix_group and "
    "prefix_tokens (a synthetic workload's own groups; otherwise the request that first had "
    "the prompt's leading block, and the leading tokens an earlier request already had, "
    "from the block hashes), session_id and round (a conversation's turns), task_class, "
    "tenant, region and deadline_s (seconds after its arrival by which it must end; empty "
    "where it has none, as only batch jobs have one)."
)
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
