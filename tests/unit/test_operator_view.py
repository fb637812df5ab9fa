"""The operators' view: what it keeps of the tables and controls, and its gauges."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from control.controllers.placement import PlacementController
from schemas import Envelope
from schemas.base import TaskClass
from schemas.control import (
    AdmissionQuotas,
    ClassQuota,
    DcWeight,
    PlacementAction,
    PlacementRecommendation,
    RoutingWeights,
)
from schemas.tables import CapacityTable, GoodputTable
from streams.memory import InMemoryBus
from tests.unit.test_quota_controller import capacity as two_ready
from tests.unit.test_quota_controller import row
from tokenfleet.controller_host import QuotaHost
from tokenfleet.operator_page import ViewMetrics, serve_operator_view
from tokenfleet.operator_view import OperatorView


class Clock:
    now = 1_000.0

    def __call__(self) -> float:
        return self.now


def goodput(dc: str, version: int, end: float, met: int, tokens_per_s: float) -> GoodputTable:
    """A window of 100 interactive requests, ``met`` of them in time (one failed, two
    cancelled, three timed out)."""
    chats = row(TaskClass.INTERACTIVE, 100, met, failures=1).model_copy(
        update={
            "output_tokens_per_s": tokens_per_s,
            "goodput_tokens_per_s": tokens_per_s * met / 100,
            "cancellations": 2,
            "timeouts": 3,
        }
    )
    start = end - 60
    return GoodputTable(
        dc=dc, version=version, window_start=start, window_end=end, classes=(chats,), tenants=()
    )


def capacity(dc: str, version: int, end: float) -> CapacityTable:
    """Two instances, 9 requests running and 4 queued, a quarter of their KV free."""
    [free] = two_ready(2).rows
    busy = free.model_copy(update={"kv_blocks_free": 50, "queued": 4, "running": 9})
    return CapacityTable(
        dc=dc, version=version, window_start=end - 60, window_end=end, rows=(busy,)
    )


def quotas(dc: str, at: float, limit: int, batch: int | None = None) -> AdmissionQuotas:
    listed = [ClassQuota(task_class=TaskClass.LONG_DOCUMENT, max_concurrency=limit)]
    if batch is not None:
        listed.append(ClassQuota(task_class=TaskClass.BATCH, max_concurrency=batch))
    return AdmissionQuotas(
        scope=dc, version=int(at) + 1, issued_at=at, ttl_s=30, quotas=tuple(listed)
    )


def weights(at: float, scope: str = "dc-a", **by_dc: float) -> RoutingWeights:
    listed = tuple(
        DcWeight(model="m", dc=dc.replace("_", "-"), weight=w) for dc, w in by_dc.items()
    )
    return RoutingWeights(scope=scope, version=int(at) + 1, issued_at=at, ttl_s=30, weights=listed)


def placement(dc: str, at: float, replicas: int) -> PlacementRecommendation:
    action = PlacementAction(model="m", model_version="1", dc=dc, target_replicas=replicas)
    return PlacementController().snapshot(dc, [action], int(at) + 1, at)


def test_the_state_holds_the_newest_tables_and_controls_of_each_dc() -> None:
    clock = Clock()
    view = OperatorView(clock)
    view.apply(goodput("dc-b", 2, 990.0, met=90, tokens_per_s=500.0))
    view.apply(goodput("dc-b", 1, 995.0, met=10, tokens_per_s=1.0))  # an older version
    view.apply(capacity("dc-b", 1, 985.0))
    view.apply(quotas("dc-b", 980.0, limit=6))
    view.apply(weights(990.0, dc_a=1.0, dc_b=0.8))
    view.apply(weights(970.0, dc_a=1.0, dc_b=0.3))  # issued before the one held
    view.apply(placement("dc-b", 980.0, replicas=3))
    view.apply(placement("dc-b", 960.0, replicas=1))  # an older version
    [dc_a, dc_b] = view.state()["dcs"]
    assert dc_a["dc"] == "dc-a"
    assert dc_a["classes"] == []
    assert dc_a["weight"] == 1.0
    assert dc_b["tables_age_s"] == 15.0  # the older of its two tables
    [row] = dc_b["classes"]
    assert (row["goodput_tokens_per_s"], row["compliance"], row["failures"]) == (450.0, 0.9, 4)
    assert dc_b["capacity"] == {
        "ready": 2,
        "running": 9,
        "queued": 4,
        "kv_used": 0.75,
        "headroom": 0.5,
    }
    assert (dc_b["weight"], dc_b["long_documents"], dc_b["batch"]) == (0.8, 6, None)
    assert (dc_a["replicas"], dc_b["replicas"]) == (None, {"m": 3})
    assert dc_b["controls_left_s"] == {"quotas": 10.0, "weights": 20.0}


def test_a_dc_shows_the_lowest_weight_an_edge_holds_and_the_soonest_ttl() -> None:
    """Each edge's weights are judged on its own region's requests, so they differ."""
    view = OperatorView(Clock())
    view.apply(weights(990.0, "dc-a", dc_a=1.0, dc_b=0.5))
    view.apply(weights(985.0, "dc-b", dc_a=0.8, dc_b=1.0))
    view.apply(weights(980.0, "dc-a", dc_a=0.2, dc_b=0.2))  # older than dc-a's held
    view.apply(weights(900.0, "dc-old", dc_a=0.1, dc_b=0.1))  # an old edge's, expired
    [dc_a, dc_b] = view.state()["dcs"]
    assert (dc_a["weight"], dc_b["weight"]) == (0.8, 0.5)
    assert dc_a["controls_left_s"]["weights"] == 15.0  # dc-b's edge's runs out first
    view.clock.now = 1100.0  # every edge's expired: the newest one's, and how long ago
    [dc_a, dc_b] = view.state()["dcs"]
    assert (dc_a["weight"], dc_b["weight"]) == (1.0, 0.5)
    assert dc_a["controls_left_s"]["weights"] == -80.0


def test_the_history_keeps_a_point_per_goodput_table_within_its_horizon() -> None:
    view = OperatorView(Clock(), history_s=30.0)
    view.apply(weights(0.0, dc_a=0.5))
    for n in range(10):
        view.apply(quotas("dc-a", 10.0 * n, limit=8 - n // 5))
        view.apply(goodput("dc-a", n + 1, 10.0 * n, met=50 + n, tokens_per_s=100.0))
    history = view.state()["dcs"][0]["history"]
    assert [point["at"] for point in history] == [60.0, 70.0, 80.0, 90.0]
    assert history[-1] == {
        "at": 90.0,
        "goodput_tokens_per_s": 59.0,
        "interactive_compliance": 0.59,
        "weight": 0.5,
        "long_documents": 7,
    }


def test_the_gauges_say_what_the_state_says() -> None:
    clock = Clock()
    view = OperatorView(clock)
    view.apply(goodput("dc-a", 1, 990.0, met=80, tokens_per_s=200.0))
    view.apply(capacity("dc-a", 1, 990.0))
    view.apply(weights(995.0, dc_a=0.64))
    view.apply(placement("dc-a", 995.0, replicas=2))
    samples = _samples(view)
    dc = (("dc", "dc-a"),)
    interactive = (("dc", "dc-a"), ("task_class", "interactive"))
    assert samples[("tokenfleet_controller_weight", dc)] == 0.64
    assert samples[("tokenfleet_controller_placed_replicas", (*dc, ("model", "m")))] == 2
    assert samples[("tokenfleet_controller_table_age_seconds", dc)] == 10.0
    assert samples[("tokenfleet_controller_goodput_tokens_per_second", interactive)] == 160.0
    assert samples[("tokenfleet_controller_compliance", interactive)] == 0.8
    left = (("dc", "dc-a"), ("kind", "weights"))
    assert samples[("tokenfleet_controller_control_ttl_left_seconds", left)] == 25.0
    assert ("tokenfleet_controller_long_documents_limit", dc) not in samples  # no quotas yet
    view.apply(quotas("dc-a", 995.0, limit=4, batch=12))
    samples = _samples(view)
    assert samples[("tokenfleet_controller_long_documents_limit", dc)] == 4
    assert samples[("tokenfleet_controller_batch_limit", dc)] == 12


def _samples(view: OperatorView) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The view's gauges as Prometheus scrapes them, by name and labels."""
    registry = CollectorRegistry()
    registry.register(ViewMetrics(view))
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
    }


def test_a_class_with_nothing_ended_in_the_window_is_left_out() -> None:
    view = OperatorView(Clock())
    table = goodput("dc-a", 1, 990.0, met=90, tokens_per_s=10.0)
    idle = table.classes[0].model_copy(
        update={"key": "batch", "completed": 0, "failures": 0, "cancellations": 0, "timeouts": 0}
    )
    view.apply(table.model_copy(update={"classes": (*table.classes, idle)}))
    [dc] = view.state()["dcs"]
    assert [row["task_class"] for row in dc["classes"]] == ["interactive"]


def test_a_class_that_completed_nothing_has_no_compliance_rather_than_none_in_time() -> None:
    """Its requests all failed or left: 0 % in time would read as every one late."""
    view = OperatorView(Clock())
    table = goodput("dc-a", 1, 990.0, met=90, tokens_per_s=10.0)
    cancelled = table.classes[0].model_copy(
        update={"key": "batch", "completed": 0, "compliance": 0.0, "cancellations": 4}
    )
    view.apply(table.model_copy(update={"classes": (*table.classes, cancelled)}))
    [dc] = view.state()["dcs"]
    assert [row["compliance"] for row in dc["classes"]] == [0.9, None]
    samples = {
        (s.labels["task_class"], s.value)
        for family in ViewMetrics(view).collect()
        if family.name == "tokenfleet_controller_compliance"
        for s in family.samples
    }
    assert samples == {("interactive", 0.9)}


def test_tables_from_two_table_workers_are_named_counted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    view = OperatorView(clock)
    old = Envelope.wrap(goodput("dc-a", 1, 900.0, 80, 200.0), source="renamed", ts=900.0)
    view.apply_envelope(old)  # a worker gone a while: not counted
    for n, source in enumerate(("tables-a", "tables-a", "tables-b")):
        table = goodput("dc-a", 2 + n, 990.0 + n, 80, 200.0)
        view.apply_envelope(Envelope.wrap(table, source=source, ts=990.0 + n))
    [dc] = view.state()["dcs"]
    assert dc["table_publishers"] == ["tables-a", "tables-b"]
    assert dc["classes"][0]["completed"] == 100  # the tables themselves still applied
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert "tables-a, tables-b" in warnings[0]
    registry = CollectorRegistry()
    registry.register(ViewMetrics(view))
    text = generate_latest(registry).decode()
    assert 'tokenfleet_controller_table_publishers{dc="dc-a"} 2.0' in text
    clock.now += 120  # both silent for two minutes: nobody publishes now
    assert view.state()["dcs"][0]["table_publishers"] == []


def test_a_controller_stopped_with_its_view_logs_no_error(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Cancelled beside a host, as ``tokenfleet controller`` stops on SIGTERM, the view's
    server left its lifespan task behind, and the loop's end logged its CancelledError as
    an ERROR with a traceback, at every ``tokenfleet down``."""

    async def stopped() -> None:
        bus = InMemoryBus()
        with socket.create_server(("127.0.0.1", 0)) as listening:
            both = asyncio.gather(QuotaHost(bus).run(), serve_operator_view(bus, listening, 1.0))
            await asyncio.sleep(0.5)
            both.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await both

    asyncio.run(stopped())  # its own loop, ended as the command's: what is left is cancelled
    assert "Traceback" not in capfd.readouterr().err  # uvicorn's log, on stderr
