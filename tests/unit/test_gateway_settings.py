from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from pydantic import ValidationError

from control.admission.slomax import SLOMax
from control.routing.cache_aware import (
    AibrixParams,
    AibrixPrefixCache,
    SglangCacheAware,
    SglangParams,
)
from control.routing.tokenpilot import TokenPilot
from gateway.settings import GatewaySettings
from gateway.state import LocalState
from schemas.fleet import FleetConfig, load_fleet
from streams.memory import InMemoryBus
from tokenfleet.gateway_wiring import _embedded, gateway_parts, published_controls

EXAMPLE = Path(__file__).parents[2] / "examples" / "fleet.toml"
THREE_DCS = EXAMPLE.with_name("fleet-local.toml")


def test_the_gateway_s_tokenpilot_assumes_the_token_lag_its_environment_sets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TOKENFLEET_GATEWAY_TOKEN_LAG_S", "0.009")
    parts = gateway_parts(load_fleet(EXAMPLE), GatewaySettings(), InMemoryBus(), LocalState())
    router = parts.make_router("emulated")
    assert isinstance(router, TokenPilot)
    assert router.params.token_lag_s == 0.009


def test_slomax_reserves_the_sequences_the_fleet_file_says_each_engine_runs() -> None:
    """The profile's engine limit is the simulator's; the fleet file names the fleet's, and
    the decision journal's recipe carries it for the auditor."""
    example = load_fleet(EXAMPLE)
    parts = gateway_parts(example, GatewaySettings(), InMemoryBus(), LocalState())
    admission = parts.make_admission("emulated")
    assert isinstance(admission, SLOMax)
    assert admission.pool is not None
    assert admission.pool.max_num_seqs == 256
    assert parts.recipe is not None
    assert parts.recipe("emulated")["max_num_seqs"] == 256
    models = [m.model_copy(update={"max_num_seqs": None}) for m in example.models]
    unknown = example.model_copy(update={"models": models})
    parts = gateway_parts(unknown, GatewaySettings(), InMemoryBus(), LocalState())
    admission = parts.make_admission("emulated")
    assert isinstance(admission, SLOMax)
    assert admission.pool is not None
    assert admission.pool.max_num_seqs is None  # KV alone is reserved


def test_every_model_s_policies_are_built_at_start() -> None:
    """A second model without the profile TokenPilot needs started, then failed each of
    its requests: only the first model's router was built at start."""
    example = load_fleet(EXAMPLE)
    bare = example.models[0].model_copy(update={"name": "bare", "profile": None})
    fleet = example.model_copy(update={"models": (*example.models, bare)})
    with pytest.raises(ValueError, match="model 'bare' has no `profile`"):
        gateway_parts(fleet, GatewaySettings(), InMemoryBus(), LocalState())


def test_an_admission_that_needs_a_prediction_behind_a_router_without_stops_the_gateway() -> None:
    """Started so, it refused every request (no_instance), on an idle fleet too."""
    settings = GatewaySettings(policy="round_robin", admission="mooncake_early_reject")
    with pytest.raises(ValueError, match="needs a router that predicts TTFT"):
        gateway_parts(load_fleet(EXAMPLE), settings, InMemoryBus(), LocalState())


def test_a_negative_token_lag_is_refused() -> None:
    with pytest.raises(ValidationError, match="token_lag_s"):
        GatewaySettings(token_lag_s=-0.001)


def _fleet_with(routing: dict[str, object]) -> FleetConfig:
    data = load_fleet(EXAMPLE).model_dump(mode="json")
    return FleetConfig.model_validate({**data, "routing": routing})


def test_the_fleet_file_s_routing_profile_picks_the_policy_and_its_parameters() -> None:
    fleet = _fleet_with({"policy": "sglang_cache_aware", "params": {"cache_threshold": 0.5}})
    parts = gateway_parts(fleet, GatewaySettings(), InMemoryBus(), LocalState())
    router = parts.make_router("emulated")
    assert isinstance(router, SglangCacheAware)
    assert router.params == SglangParams(cache_threshold=0.5)  # the others as shipped


def test_a_policy_set_for_the_gateway_runs_with_its_own_defaults() -> None:
    fleet = _fleet_with({"policy": "sglang_cache_aware", "params": {"cache_threshold": 0.5}})
    settings = GatewaySettings(policy="aibrix_prefix_cache")
    router = gateway_parts(fleet, settings, InMemoryBus(), LocalState()).make_router("emulated")
    assert isinstance(router, AibrixPrefixCache)
    assert router.params == AibrixParams()


def test_tokenpilot_takes_the_profile_s_lag_unless_the_environment_sets_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fleet = _fleet_with({"params": {"token_lag_s": 0.007, "tie_band": 0.05}})
    router = gateway_parts(fleet, GatewaySettings(), InMemoryBus(), LocalState()).make_router(
        "emulated"
    )
    assert isinstance(router, TokenPilot)
    assert (router.params.token_lag_s, router.params.tie_band) == (0.007, 0.05)
    monkeypatch.setenv("TOKENFLEET_GATEWAY_TOKEN_LAG_S", "0.009")
    router = gateway_parts(fleet, GatewaySettings(), InMemoryBus(), LocalState()).make_router(
        "emulated"
    )
    assert isinstance(router, TokenPilot)
    assert (router.params.token_lag_s, router.params.tie_band) == (0.009, 0.05)


@pytest.mark.parametrize(
    ("routing", "message"),
    [
        ({"policy": "no_such_policy"}, "unknown policy 'no_such_policy'"),
        ({"policy": "aibrix_prefix_cache", "params": {"std": 2}}, "takes no std"),
        ({"policy": "power_of_two", "params": {"choice_count": "two"}}, "choice_count"),
        ({"policy": "round_robin", "params": {"x": 1}}, "it takes: none"),
        ({"policy": "power_of_two", "params": {"choice_count": 1}}, "greater than or equal to 2"),
        ({"policy": "power_of_two", "params": {"choice_count": True}}, "valid integer"),
        ({"params": {"index_stride": 0}}, "index_stride"),
        ({"params": {"token_lag_s": -0.001}}, "token_lag_s"),
        ({"policy": "sglang_cache_aware", "params": {"cache_threshold": 2}}, "cache_threshold"),
    ],
)
def test_a_bad_routing_profile_stops_the_gateway_with_a_message(
    routing: dict[str, object], message: str
) -> None:
    with pytest.raises((ValueError, KeyError), match=message):
        gateway_parts(_fleet_with(routing), GatewaySettings(), InMemoryBus(), LocalState())


def test_the_profile_is_checked_even_where_the_gateway_runs_another_policy() -> None:
    fleet = _fleet_with({"policy": "aibrix_prefix_cache", "params": {"std": 2}})
    with pytest.raises(ValueError, match="takes no std"):
        gateway_parts(fleet, GatewaySettings(policy="round_robin"), InMemoryBus(), LocalState())


async def test_an_embedded_part_that_stops_on_an_error_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The tasks were gathered only at shutdown: a table host that stopped left the
    tables stale without a word."""

    async def breaks() -> None:
        raise RuntimeError("the bus refused")

    with caplog.at_level("ERROR", logger="tokenfleet.gateway_wiring"):
        task = _embedded(breaks(), "tables")
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)  # the done callback runs
    [said] = [r for r in caplog.records if r.getMessage() == "the embedded tables stopped"]
    assert said.exc_info is not None
    assert "the bus refused" in str(said.exc_info[1])


@pytest.mark.parametrize(
    ("fleet_file", "admission", "embedded", "controls"),
    [
        (EXAMPLE, "slomax", True, {"quotas"}),  # one DC: no DC to weigh
        (EXAMPLE, "fcfs", True, set()),  # no controller steers it
        (THREE_DCS, "slomax", True, {"quotas", "weights"}),
        (THREE_DCS, "fcfs", True, {"weights"}),
        (EXAMPLE, "fcfs", False, {"quotas", "weights"}),  # the deployed controller's
    ],
)
def test_a_gateway_watches_only_the_controls_a_controller_publishes_to_it(
    fleet_file: Path, admission: str, embedded: bool, controls: set[str]
) -> None:
    """A control nobody publishes would read "on defaults" for ever in the gauge."""
    settings = GatewaySettings(admission=admission)
    assert published_controls(load_fleet(fleet_file), settings, embedded) == controls
