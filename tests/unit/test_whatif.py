"""What-if: the recorded arrivals, and re-simulating them."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from schemas import Envelope
from schemas.fleet import load_fleet
from schemas.lifecycle import RequestArrived, RequestCompleted
from sim.events import lifecycle_events
from sim.run import RunConfig, simulate_run
from tokenfleet.whatif import Stack, recorded, whatif

LOCAL_FLEET = Path(__file__).parents[2] / "examples" / "fleet-local.toml"


def simulated_events(policy: str, requests: int = 200) -> list[Envelope]:
    """A simulated run's lifecycle events on dc-a's two instances, ten minutes ago."""
    _, records = simulate_run(
        RunConfig("azure-conv", instances=2, requests=requests, policy=policy)
    )
    in_dc_a = [dataclasses.replace(r, dc="dc-a") for r in records]
    return lifecycle_events(in_dc_a, model="emulated", epoch=time.time() - 600)


def test_arrivals_keep_their_dc_and_their_recorded_length_and_unrouted_ones_are_counted() -> None:
    events = simulated_events("round_robin", requests=20)
    refused = RequestArrived(
        request_id="refused",
        tenant="demo",
        task_class="interactive",
        model="emulated",
        input_tokens=10,
        output_budget=64,
        source_region="eu-west",
    )
    record = recorded([*events, Envelope.wrap(refused, source="test")])
    assert record.unrouted == 1
    [(dc, workload)] = record.workloads.items()
    assert dc == "dc-a"
    assert len(workload) == 20
    assert workload[0].arrival_s == 0.0
    lengths = {
        e.payload.request_id: e.payload.output_tokens
        for e in events
        if isinstance(e.payload, RequestCompleted)
    }
    assert all(r.output_tokens == max(1, lengths[r.request_id]) for r in workload)
    assert record.measured["dc-a"]["completed"] == 20


def test_the_stack_that_ran_reproduces_what_its_clients_got_and_another_differs() -> None:
    """Events of a round-robin run, re-simulated under round robin, give back its TTFTs;
    under least-loaded routing they do not."""
    record = recorded(simulated_events("round_robin"))
    fleet = load_fleet(LOCAL_FLEET)
    same, other = Stack("round_robin", "fcfs"), Stack("least_requests", "fcfs")
    [figures] = whatif(record, fleet, [same, other], dcs=["dc-a"]).values()
    measured = figures["measured"]
    assert figures[same.name]["ttft_p95_s"] == pytest.approx(measured["ttft_p95_s"], rel=1e-3)
    assert figures[same.name]["ttft_p50_s"] == pytest.approx(measured["ttft_p50_s"], rel=1e-3)
    assert figures[other.name]["ttft_p95_s"] != pytest.approx(measured["ttft_p95_s"], rel=1e-3)
    assert figures["instances"] == 2
