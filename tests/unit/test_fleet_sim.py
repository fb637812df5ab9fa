"""The multi-DC simulator: an edge that sees the DCs through delayed tables and its own
counts, in front of one simulated pool per DC; and the fleet bench's pieces."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from control.fleet.registry import DC_POLICIES, make_dc_policy
from schemas.base import TaskClass
from sim.clients import RETRY_SUFFIX, ClientModel
from sim.fleet_bench import (
    HOTSPOT_S,
    STACKS,
    VARIANTS,
    Scenario,
    fleet_figures,
    mismatch,
    offered_tok_s,
    paced,
    react_s,
    region_figures,
    stack_simulation,
)
from sim.fleet_sim import EdgeChoice, FleetLayout, FleetSimulation, PublishedLoad, Site
from sim.profiles import profile
from sim.workload import TraceRequest

PROFILE = profile("llama3-70b-4xh100")
EU = ("eu-west", "eu-central")
LAYOUT = FleetLayout(
    (Site("dc-b", "eu-central", 1), Site("dc-d", "us-east", 1, ready_at_s=5.0)),
    {
        ("eu-west", "eu-central"): 0.01,
        ("eu-central", "eu-west"): 0.01,
        ("eu-west", "us-east"): 0.08,
        ("us-east", "eu-west"): 0.08,
        ("eu-central", "us-east"): 0.09,
        ("us-east", "eu-central"): 0.09,
    },
    {"eu-west": "dc-b", "eu-central": "dc-b", "us-east": "dc-d"},
    {"tenant-d": frozenset({"dc-b"})},
)


def chats(
    count: int, rate_rps: float, region: str = "eu-west", **fields: object
) -> list[TraceRequest]:
    return [
        TraceRequest(f"{region}-{n}", n / rate_rps, 2000, 200, (), region=region, **fields)  # type: ignore[arg-type]
        for n in range(count)
    ]


def simulate(policy: str, requests: list[TraceRequest]) -> FleetSimulation:
    simulation = FleetSimulation(
        LAYOUT, PROFILE, make_dc_policy(policy), capacity_rps_per_instance=4.0
    )
    simulation.records = simulation.run(sorted(requests, key=lambda r: r.arrival_s))  # type: ignore[attr-defined]
    return simulation


def test_local_only_keeps_every_request_home_and_refuses_while_home_warms_up() -> None:
    simulation = simulate("local_only", chats(60, 6.0) + chats(30, 3.0, "us-east"))
    records = simulation.records  # type: ignore[attr-defined]
    assert {r.dc for r in records if r.request_id.startswith("eu-west")} == {"dc-b"}
    us = [r for r in records if r.request_id.startswith("us-east")]
    refused = [r for r in us if r.dc is None]
    assert refused
    assert all(r.outcome == "rejected" and r.arrival_s < 6.0 for r in refused)
    assert {r.dc for r in us if r.dc is not None} == {"dc-d"}


def test_a_client_the_edge_refuses_tries_again_as_one_a_dc_refused_does() -> None:
    """us-east's home warms up until 5 s: its refused chats' clients that retry (half of
    them) come back a second later through the edge, and those back after it is ready run."""
    requests = chats(30, 3.0, "us-east")
    simulation = FleetSimulation(
        LAYOUT,
        PROFILE,
        make_dc_policy("local_only"),
        capacity_rps_per_instance=4.0,
        clients=ClientModel(),
    )
    records = simulation.run(requests)
    refused = {r.request_id for r in records if r.dc is None}
    retried = [c for c in simulation.choices if c.request.request_id.endswith(RETRY_SUFFIX)]
    assert refused
    assert retried
    assert {c.request.request_id.removesuffix(RETRY_SUFFIX) for c in retried} <= refused
    assert all(c.at_s >= 1.0 for c in retried)
    assert any(c.chosen == "dc-d" for c in retried)


def test_nothing_runs_in_a_dc_before_the_edge_hears_it_is_ready() -> None:
    simulation = simulate("skyserve_least_load", chats(120, 12.0))
    first_in_d = min(c.at_s for c in simulation.choices if c.chosen == "dc-d")
    # ready at 5 s, published each second, heard a second later
    assert first_in_d >= 5.0 + simulation.view_delay_s


def test_fleetmind_spills_a_hotspot_but_never_a_resident_or_restricted_request() -> None:
    bound = chats(200, 20.0, residency=EU)
    restricted = [
        replace(r, request_id=f"t-{r.request_id}", tenant="tenant-d") for r in chats(100, 10.0)
    ]
    free = [replace(r, request_id=f"f-{r.request_id}") for r in chats(200, 20.0)]
    simulation = simulate("fleetmind", bound + restricted + free)
    placed = {c.request.request_id: c.chosen for c in simulation.choices if c.chosen}
    assert all(placed[r.request_id] == "dc-b" for r in bound + restricted if r.request_id in placed)
    assert sum(dc == "dc-d" for dc in placed.values()) > 50  # the unbound overflow


def test_the_offered_goodput_is_every_arrivals_output_over_the_span() -> None:
    """What bounds every policy's goodput: each arrival's output tokens, once."""
    requests = chats(30, 3.0)  # 200 output tokens each
    assert offered_tok_s(requests, 10.0) == 30 * 200 / 10.0
    simulation = simulate("fleetmind", requests)
    made = region_figures(simulation.records, 10.0)["goodput_tok_s"]  # type: ignore[attr-defined]
    assert 0.9 * offered_tok_s(requests, 10.0) <= made <= offered_tok_s(requests, 10.0)


@pytest.mark.parametrize("policy", sorted(DC_POLICIES))
def test_a_run_is_a_function_of_its_inputs(policy: str) -> None:
    requests = chats(80, 16.0) + chats(20, 4.0, "us-east")
    first = simulate(policy, requests).records  # type: ignore[attr-defined]
    second = simulate(policy, requests).records  # type: ignore[attr-defined]
    assert first == second
    assert len(first) >= len(requests)


def test_the_hotspot_s_figures_are_also_given_per_class() -> None:
    """A long document's TTFT objective is 30 s, a chat's 2 s: one P95 over both says
    mostly how many documents ran."""
    requests = chats(100, 1.0) + [
        replace(r, request_id=f"doc-{r.request_id}", task_class=TaskClass.LONG_DOCUMENT)
        for r in chats(10, 0.1)
    ]
    simulation = simulate("fleetmind", requests)
    hotspot = fleet_figures(simulation.records, simulation, requests)["hotspot"]  # type: ignore[attr-defined]
    in_hotspot = [r for r in requests if HOTSPOT_S[0] <= r.arrival_s < HOTSPOT_S[1]]
    assert hotspot["arrivals"] == len(in_hotspot) == 40 + 4
    per_class = hotspot["per_class"]
    assert {c: f["arrivals"] for c, f in per_class.items()} == {
        "interactive": 40,
        "long_document": 4,
    }


def test_paced_arrivals_follow_the_pieces_rates_and_keep_their_order() -> None:
    stream = chats(3000, 10.0)
    out = paced(stream, [(0.0, 5.0), (10.0, 20.0), (20.0, 5.0)], 30.0)
    times = [r.arrival_s for r in out]
    assert times == sorted(times)
    assert [r.request_id for r in out] == [r.request_id for r in stream[: len(out)]]
    per_piece = [sum(a <= t < b for t in times) for a, b in ((0, 10), (10, 20), (20, 30))]
    assert per_piece == pytest.approx([50, 200, 50], abs=1)


def test_a_stream_too_short_for_its_pieces_comes_again_until_the_end() -> None:
    """100 chats asked for at 20 a second for 30 s: run six times, as requests of their own,
    so the last seconds still see arrivals at the pieces' rate; a later pass's prompts
    share prefixes among themselves as the first pass's did, none with it."""
    stream = [
        replace(chat, prefix_blocks=(7, 8 + n % 2)) for n, chat in enumerate(chats(100, 10.0))
    ]
    out = paced(stream, [(0.0, 20.0)], 30.0)
    times = [r.arrival_s for r in out]
    assert len(out) == pytest.approx(600, abs=1)
    assert times == sorted(times)
    assert sum(25.0 <= t < 30.0 for t in times) == pytest.approx(100, abs=1)
    assert len({r.request_id for r in out}) == len(out)
    second = out[100:200]
    assert len({r.prefix_blocks for r in second}) == 2  # two prompts, as in the first pass
    assert {r.prefix_blocks[0] for r in second}.isdisjoint({7})
    assert out[100].request_id == f"{stream[0].request_id}~2"


def test_mismatch_counts_queues_only_while_another_ready_dc_has_none() -> None:
    def load(queued: int, ready: bool = True) -> PublishedLoad:
        return PublishedLoad(0.0, ready, 10, queued, 0.5, 1.0)

    tables = [
        {"b": load(8), "c": load(0)},  # 8 wait while c idles
        {"b": load(8), "c": load(2)},  # both queue: nothing idles
        {"b": load(8), "c": load(0, ready=False)},  # c cannot take them
        {"b": load(0), "c": load(0)},
    ]
    assert mismatch(tables, 2.0) == 16.0


def test_reacting_is_sending_the_hotspot_s_overflow_away_not_already_sending_some() -> None:
    """An edge that spreads A's traffic evenly before and during the hotspot reacts as
    soon as the extra traffic goes abroad (the first whole window, 5 s); one that keeps
    A home reacts once it spills, here by falling back from B from 10 s in; one that
    never spills never reacts. A request counts where it went last."""
    simulation = FleetSimulation(LAYOUT, PROFILE, make_dc_policy("fleetmind"))
    home, start = LAYOUT.home["eu-west"], HOTSPOT_S[0]

    def sent(n: int, at_s: float, *dcs: str) -> list[EdgeChoice]:
        request = TraceRequest(f"r{n}", at_s, 100, 10, (), region="eu-west")
        return [EdgeChoice(at_s, request, dc, fallback=k > 0) for k, dc in enumerate(dcs)]

    def run(spills: Callable[[int, float], bool]) -> float | None:
        choices, n, at_s = [], 0, start - 60.0
        while at_s < start + 60.0:
            choices += sent(n, at_s, home, "dc-d") if spills(n, at_s) else sent(n, at_s, home)
            n, at_s = n + 1, at_s + (0.5 if at_s < start else 0.125)  # 2, then 8 a second
        simulation.choices = choices
        return react_s(simulation)

    assert run(lambda n, _: n % 2 == 1) == 5.0
    assert run(lambda n, at_s: at_s >= start + 10.0 and n % 2 == 1) == 11.0
    assert run(lambda n, _: False) is None


def test_the_long_cycle_places_replicas_on_idle_gpus_that_serve_after_their_warm_up() -> None:
    from control.controllers.placement import PlacementController

    standby = FleetLayout(
        (Site("dc-b", "eu-central", 1, standby=1), Site("dc-d", "us-east", 1)),
        LAYOUT.round_trips_s,
        LAYOUT.home,
    )
    simulation = FleetSimulation(
        standby,
        PROFILE,
        make_dc_policy("local_only"),
        capacity_rps_per_instance=2.0,
        placement=PlacementController(),
        placement_every=10,
        warmup_s=15.0,
    )
    simulation.run(chats(600, 10.0))  # 10 a second for a minute: 5 times one replica's rate
    placed_at = min(at for at, deployed in simulation.placement_steps if deployed["dc-b"] == 2)
    served = [r for r in simulation.simulations[0].records if r.instance_id == "dc-b/1"]
    assert served  # the new replica took requests
    assert min(r.arrival_s for r in served) >= placed_at + 15.0 - 1.0  # once it had loaded


def test_a_replica_counts_as_the_dc_s_once_loaded_and_never_if_taken_back_while_loading() -> None:
    """A placement that starts a replica on dc-b's standby GPU, then takes it back before
    it has loaded: while it loads, the tables count it deployed but not among the DC's
    instances (as a gateway counts a standby instance only once it serves), and it never
    serves."""

    class Scripted:
        """dc-b's replicas: 2 at the first pass, 1 from the second on."""

        passes = 0

        def targets(self, *_: object) -> dict[str, tuple[int, str]]:
            self.passes += 1
            return {"dc-b": (2 if self.passes == 1 else 1, "scripted")}

    standby = FleetLayout(
        (Site("dc-b", "eu-central", 1, standby=1), Site("dc-d", "us-east", 1)),
        LAYOUT.round_trips_s,
        LAYOUT.home,
    )
    seen: set[int] = set()

    def dc_b_instances(fleet: FleetSimulation) -> None:
        [state] = [dc for dc in fleet.view(chats(1, 1.0)[0]).dcs if dc.name == "dc-b"]
        seen.add(state.instances)

    simulation = FleetSimulation(
        standby,
        PROFILE,
        make_dc_policy("local_only"),
        capacity_rps_per_instance=2.0,
        placement=Scripted(),  # type: ignore[arg-type]
        placement_every=10,
        warmup_s=15.0,
        observe=dc_b_instances,
    )
    simulation.run(chats(600, 10.0))
    loading = [t["dc-b"] for t in simulation.tables if t["dc-b"].loading]
    assert loading
    assert {(t.deployed, t.loading, t.ready_instances) for t in loading} == {(2, 1, 1)}
    assert seen == {1}  # as the edge sees dc-b throughout
    assert not [r for r in simulation.simulations[0].records if r.instance_id == "dc-b/1"]


def test_the_variant_without_the_operator_s_figure_runs_fleetmind_without_it() -> None:
    case = Scenario((), 4.9, LAYOUT)
    given = stack_simulation(STACKS["fleetmind"], case, "llama3-70b-4xh100", 0)
    assert given.capacity_rps_per_instance == 4.9
    variant = VARIANTS["fleetmind_without_rps_per_instance"]
    assert variant.name not in STACKS  # run only when named
    without = stack_simulation(variant, case, "llama3-70b-4xh100", 0)
    assert (without.policy.name, without.capacity_rps_per_instance) == ("fleetmind", None)
