"""The Grafana dashboards ask only for metrics, and labels, that TokenFleet exports: the
gateways', the controller's and the table worker's."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
from prometheus_client.registry import Collector

from gateway.metrics import GatewayMetrics
from streams.faust_parts import WorkerApp, WorkerMetrics
from tests.unit.test_operator_view import Clock, capacity, goodput, placement, quotas, weights
from tokenfleet.operator_page import ViewMetrics
from tokenfleet.operator_view import OperatorView

DASHBOARDS = Path(__file__).parents[2] / "examples" / "grafana"
Exported = dict[str, set[str]]
"""Each sample name that can be exported, with the labels it carries."""


def gateway_families() -> dict[str, tuple[str, set[str]]]:
    """Each of the gateway's metric families, by name: its type and labels."""
    registry = GatewayMetrics().registry
    labels_of = {
        collector._name: set(collector._labelnames)  # type: ignore[attr-defined]
        for collector in registry._collector_to_names  # type: ignore[attr-defined]
        if hasattr(collector, "_labelnames")
    }
    return {f.name: (f.type, labels_of.get(f.name, set())) for f in registry.collect()}


def gateway_metrics() -> Exported:
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    return {
        name + suffix: labels | {"le"}
        for name, (kind, labels) in gateway_families().items()
        for suffix in suffixes.get(kind, ("",))
    }


def test_the_gateway_s_docs_name_every_series_with_its_labels() -> None:
    """``docs/gateway.md``, "Metrics", where operators look a series up."""
    docs = (DASHBOARDS.parents[1] / "docs" / "gateway.md").read_text()
    rows = re.findall(r"^\| `(tokenfleet_gateway_\w+)` \|([^|]*)\|", docs, re.MULTILINE)
    documented = {name: set(re.findall(r"`(\w+)`", labels)) for name, labels in rows}
    exported = {
        name + ("_total" if kind == "counter" else ""): labels
        for name, (kind, labels) in gateway_families().items()
        if name.startswith("tokenfleet_gateway_")
    }
    assert documented == exported


def controller_metrics() -> Exported:
    """What the controller's view exports once every table and control has arrived."""
    view = OperatorView(Clock())
    for message in (
        goodput("dc-a", 1, 990.0, met=90, tokens_per_s=100.0),
        capacity("dc-a", 1, 990.0),
        quotas("dc-a", 990.0, limit=4, batch=8),
        weights(990.0, dc_a=1.0),
        placement("dc-a", 990.0, replicas=2),
    ):
        view.apply(message)
    return exported_by(ViewMetrics(view))


def queries(dashboard: str) -> list[str]:
    panels = json.loads((DASHBOARDS / dashboard).read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel["targets"]]


def unknown_in(expressions: list[str], prefix: str, exported: Exported) -> list[str]:
    """What each expression asks for that is not exported: a metric, or a label of one."""
    wrong = []
    for expression in expressions:
        used = set(re.findall(r"(\w+)=", expression)) | {
            label.strip()
            for group in re.findall(r"by \(([^)]*)\)", expression)
            for label in group.split(",")
        }
        for name in re.findall(prefix + r"[a-z_]+", expression):
            if name not in exported:
                wrong.append(f"{name} is not exported")
            elif not used <= exported[name]:
                wrong.append(f"{expression}: labels {sorted(used - exported[name])}")
    return wrong


def test_the_gateways_dashboard_asks_for_what_the_gateway_exports() -> None:
    expressions = queries("tokenfleet-gateways.json")
    assert len(expressions) >= 10
    assert unknown_in(expressions, "tokenfleet_gateway_", gateway_metrics()) == []


def worker_metrics() -> Exported:
    """What the table worker exports once it has taken in, dead-lettered and published."""
    tallies = SimpleNamespace(
        processed=Counter({"lifecycle": 3}),
        dead_lettered=Counter({"tf.completions": 1}),
        dead_letters_unsent=Counter({"tf.completions": 1}),
        published=Counter({"tf.tables.goodput": 2}),
    )
    return exported_by(WorkerMetrics(cast(WorkerApp, tallies)))


def exported_by(collector: Collector) -> Exported:
    """Each sample a custom collector yields, with its labels."""
    return {
        sample.name: set(sample.labels)
        for family in collector.collect()
        for sample in family.samples
    }


@pytest.mark.parametrize(
    ("dashboard", "prefix", "panels", "exporting"),
    [
        ("tokenfleet-controller.json", "tokenfleet_controller_", 9, controller_metrics),
        ("tokenfleet-worker.json", "tokenfleet_worker_", 4, worker_metrics),
    ],
)
def test_a_part_s_dashboard_has_a_panel_for_each_of_its_metrics_and_no_other(
    dashboard: str, prefix: str, panels: int, exporting: Callable[[], Exported]
) -> None:
    """The controller's gauges and the worker's counters: every query asks for what the
    part exports, and every metric it exports has its panel."""
    expressions = queries(dashboard)
    exported = exporting()
    assert len(expressions) == panels
    assert unknown_in(expressions, prefix, exported) == []
    asked = {n for e in expressions for n in re.findall(prefix + r"[a-z_]+", e)}
    assert asked == set(exported)
