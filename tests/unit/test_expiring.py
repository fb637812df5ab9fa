"""Entries that expire, swept once their dict has doubled since the last sweep."""

from __future__ import annotations

from gateway.state import SWEEP_AT, Expiring


def test_expired_entries_go_at_a_sweep_and_live_ones_cost_no_sweep_each() -> None:
    entries: Expiring[float] = Expiring(float)
    for n in range(SWEEP_AT):
        entries[f"old-{n}"] = 10.0  # expired by 20.0
    entries.sweep(20.0)
    assert len(entries) == SWEEP_AT  # not past the mark: kept
    entries["live"] = 100.0
    entries.sweep(20.0)
    assert list(entries) == ["live"]
    for n in range(3 * SWEEP_AT):  # live keys: swept at the mark, then not again till 2x
        entries[f"live-{n}"] = 100.0
        entries.sweep(20.0)
    assert len(entries) == 3 * SWEEP_AT + 1
    # swept at SWEEP_AT + 1 entries and at twice that + 1, not at each addition since
    assert entries._sweep_at == 2 * (2 * (SWEEP_AT + 1) + 1)
