from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from control.routing.tokenpilot import TokenPilot
from gateway.settings import GatewaySettings
from gateway.state import LocalState
from schemas.fleet import load_fleet
from streams.memory import InMemoryBus
from tokenfleet.gateway_wiring import gateway_parts

EXAMPLE = Path(__file__).parents[2] / "examples" / "fleet.toml"


def test_the_gateway_s_tokenpilot_assumes_the_token_lag_its_environment_sets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TOKENFLEET_GATEWAY_TOKEN_LAG_S", "0.009")
    parts = gateway_parts(load_fleet(EXAMPLE), GatewaySettings(), InMemoryBus(), LocalState())
    router = parts.make_router("emulated")
    assert isinstance(router, TokenPilot)
    assert router.params.token_lag_s == 0.009


def test_a_negative_token_lag_is_refused() -> None:
    with pytest.raises(ValidationError, match="token_lag_s"):
        GatewaySettings(token_lag_s=-0.001)
