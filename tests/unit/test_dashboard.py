"""The Grafana dashboard asks only for metrics, and labels, the gateway exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from gateway.metrics import GatewayMetrics

DASHBOARD = Path(__file__).parents[2] / "examples" / "grafana" / "tokenfleet-gateways.json"


def exported(metrics: GatewayMetrics) -> set[str]:
    """Each sample name the gateway's registry can export."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    return {
        family.name + suffix
        for family in metrics.registry.collect()
        for suffix in suffixes.get(family.type, ("",))
    }


def test_every_query_names_an_exported_metric_and_its_labels() -> None:
    metrics = GatewayMetrics()
    known = exported(metrics)
    labels_of = {
        collector._name: set(collector._labelnames)  # type: ignore[attr-defined]
        for collector in metrics.registry._collector_to_names  # type: ignore[attr-defined]
        if hasattr(collector, "_labelnames")
    }
    expressions = [
        target["expr"]
        for panel in json.loads(DASHBOARD.read_text())["panels"]
        for target in panel["targets"]
    ]
    assert len(expressions) >= 10
    for expression in expressions:
        for name in re.findall(r"tokenfleet_gateway_[a-z_]+", expression):
            assert name in known, f"{name} is not exported"
            base = re.sub(r"_(total|bucket|sum|count)$", "", name)
            used = set(re.findall(r"(\w+)=", expression)) | set(
                label.strip()
                for group in re.findall(r"by \(([^)]*)\)", expression)
                for label in group.split(",")
            )
            assert used <= labels_of.get(base, set()) | {"le"}, (expression, used)
