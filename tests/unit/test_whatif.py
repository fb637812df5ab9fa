"""What-if: the recorded arrivals, and re-simulating them."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from schemas import Envelope
from schemas.fleet import load_fleet
from schemas.lifecycle import RequestArrived, RequestCancelled, RequestCompleted, RequestRejected
from sim.events import lifecycle_events
from sim.run import RunConfig, simulate_run
from tokenfleet.whatif import Stack, fleet_layout, recorded, whatif, whatif_fleet

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
    in_dc = [refused.model_copy(update={"request_id": rid}) for rid in ("held-too-long", "left")]
    ends = [
        RequestRejected(request_id="held-too-long", reason="deadline", dc="dc-a"),
        RequestCancelled(request_id="left", reason="client_disconnect", dc="dc-a"),
    ]
    record = recorded(
        [*events, *(Envelope.wrap(e, source="test") for e in [refused, *in_dc, *ends])]
    )
    assert record.unrouted == 1
    [(dc, workload)] = record.workloads.items()
    assert dc == "dc-a"
    assert len(workload) == 22  # the DC's admission turned two away: its workload too
    assert workload[0].arrival_s == 0.0
    lengths = {
        e.payload.request_id: e.payload.output_tokens
        for e in events
        if isinstance(e.payload, RequestCompleted)
    }
    assert all(r.output_tokens == max(1, lengths.get(r.request_id, 64)) for r in workload)
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


def chats_entering(region: str, count: int, every_s: float, tenant: str) -> list[Envelope]:
    """Chats a gateway in ``region`` took, one every ``every_s``, none of them routed."""
    return [
        Envelope.wrap(
            RequestArrived(
                request_id=f"{tenant}-{n}",
                tenant=tenant,
                task_class="interactive",
                model="emulated",
                input_tokens=2000,
                output_budget=200,
                source_region=region,
            ),
            source="test",
            ts=1000.0 + n * every_s,
        )
        for n in range(count)
    ]


def test_the_fleet_what_if_re_makes_the_choice_of_dc_within_the_tenants_dcs() -> None:
    """dc-a's gateway took more than dc-a serves: kept at home, as local_only keeps
    it, or spread, as FleetMind spreads it."""
    fleet = load_fleet(LOCAL_FLEET)
    events = chats_entering("eu-west", 300, 0.02, "demo")
    events += chats_entering("eu-west", 100, 0.06, "eu-only")
    record = recorded(events)
    assert record.unrouted == 400
    assert {r.region for r in record.arrivals} == {"eu-west"}
    layout = fleet_layout(fleet, {"eu-west"})
    assert layout.home == {"eu-west": "dc-a"}
    assert layout.rtt_s("eu-west", "us-east") == 0.08
    figures = whatif_fleet(record, fleet, ["local_only", "fleetmind"])
    home, spread = figures["local_only"], figures["fleetmind"]
    assert home["cross_dc_share"] == 0.0
    assert (home["per_dc"]["dc-b"], home["per_dc"]["dc-c"]) == (0, 0)
    assert home["refused"] > 0  # dc-a's SLOMax turned away what it could not serve
    assert spread["cross_dc_share"] > 0.2
    assert spread["refused"] < home["refused"]
    assert spread["goodput_tok_s"] > home["goodput_tok_s"]


def test_the_fleet_what_if_refuses_a_fleet_of_several_models() -> None:
    """The multi-DC simulator has one model: it would send requests where theirs is not."""
    fleet = load_fleet(LOCAL_FLEET)
    other = fleet.models[0].model_copy(update={"name": "other"})
    two = fleet.model_copy(update={"models": (*fleet.models, other)})
    with pytest.raises(ValueError, match="one model"):
        whatif_fleet(recorded(chats_entering("eu-west", 5, 0.1, "demo")), two, ["local_only"])
