"""Whether the control loop is closed, from the latest tables and controls."""

from __future__ import annotations

from schemas import Envelope
from schemas.control import AdmissionQuotas
from tests.unit.test_quota_controller import capacity, table
from tokenfleet.loop_status import loop_checks, publisher_checks, verdict

NOW = 1_000.0


def latest(table_end: float, quotas_issued: float | None) -> dict[str, dict[str, Envelope]]:
    topics = {
        "tf.tables.goodput": {"dc": Envelope.wrap(table((100, 96), now=table_end), source="t")},
        "tf.tables.capacity": {"dc": Envelope.wrap(capacity(2, now=table_end), source="t")},
    }
    if quotas_issued is not None:
        quotas = AdmissionQuotas(
            scope="dc", version=3, issued_at=quotas_issued, ttl_s=60, quotas=()
        )
        topics["tf.control.quotas"] = {"dc": Envelope.wrap(quotas, source="t")}
    return topics


def test_fresh_tables_and_controls_in_force_close_the_loop() -> None:
    checks = loop_checks(latest(NOW - 2, NOW - 10), NOW)
    assert all(c.ok for c in checks)
    assert verdict(checks) == (True, "tables fresh and controls in force")


def test_a_stale_table_an_expired_control_or_none_at_all_leave_it_open() -> None:
    stale = verdict(loop_checks(latest(NOW - 40, NOW - 10), NOW))
    assert not stale[0]
    assert "tf.tables.goodput[dc] 40.0 s old" in stale[1]
    expired = verdict(loop_checks(latest(NOW - 2, NOW - 70), NOW))
    assert expired == (False, "tf.control.quotas[dc] version 3, expired 10 s ago")
    assert verdict(loop_checks(latest(NOW - 2, None), NOW))[0] is False  # no controller
    assert "tokenfleet worker" in verdict(loop_checks({}, NOW))[1]


def test_tables_from_two_table_workers_leave_it_open_naming_both() -> None:
    closed = loop_checks(latest(NOW - 2, NOW - 10), NOW)
    gone = NOW - 61  # a worker that last published over a minute ago is not counted
    one = {"dc": {"tokenfleet-tables": NOW - 1, "tables-2": gone}, "dc-b": {"a": NOW, "b": NOW}}
    assert verdict(closed + publisher_checks(one, NOW, only=["dc"]))[0]
    two = {"dc": {"tokenfleet-tables": NOW - 1, "tables-2": NOW - 59}}
    opened, why = verdict(closed + publisher_checks(two, NOW))
    assert not opened
    assert why == (
        "table workers[dc] tables-2, tokenfleet-tables: run one app id (TOKENFLEET_WORKER_APP_ID)"
    )
