"""A gateway's admission host with SLOMax in front of one ready instance, and long
documents arriving at it: the live admission tests' host without HTTP."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Mapping

import numpy as np

from control.admission.slomax import SLOMax, SLOMaxParams
from control.routing import FleetSnapshot, Router, RouteRequest, make_router
from gateway.admission import Admitted, GatewayAdmission, Waiting
from gateway.inbound import Inbound, read_inbound
from gateway.metrics import GatewayMetrics
from gateway.state import AdmissionLoads, SlotClaim
from schemas.control import AdmissionQuotas
from schemas.objectives import Objectives
from tests.gateway_harness import (
    chat,
    fleet_for,
)

READY = FleetSnapshot(("i0",), *(np.array([v]) for v in (True, 0, 0, 0, 0, 100)), np.array([0.0]))
"""One ready instance: a ceiling of four long documents."""


def slomax_host(
    loads: Callable[[str, Mapping[str, SlotClaim]], Awaitable[AdmissionLoads]],
    quotas: AdmissionQuotas | None = None,
    heard_for_s: float = 1.5,
    tick_s: float = 0.05,
    held_quotas: list[AdmissionQuotas] | None = None,
    router: Callable[[], Router] = lambda: make_router("round_robin"),
    params: SLOMaxParams | None = None,
) -> GatewayAdmission:
    """A gateway's admission host with SLOMax (``params``), in front of ``READY``, under
    ``quotas`` (or the last of ``held_quotas`` as it is when asked), sharing its load
    through ``loads``."""
    now = [quotas] if held_quotas is None else held_quotas

    async def snapshot(_model: str, _dc: str) -> FleetSnapshot:
        return READY

    return GatewayAdmission(
        lambda _model: SLOMax(params or SLOMaxParams()),
        lambda _model, _dc: router(),
        snapshot,
        Objectives(),
        GatewayMetrics(),
        loads,
        tick_s=tick_s,
        pool_now=lambda _model, _dc: (1, now[-1]),
        heard_for_s=heard_for_s,
    )


def document(
    host: GatewayAdmission,
    quotas: AdmissionQuotas | None = None,
    snapshot: FleetSnapshot = READY,
) -> tuple[Inbound, Admitted | Waiting]:
    """A long document arriving at ``host`` now (on ``snapshot``), and where admission put
    it."""
    fleet = fleet_for(["http://127.0.0.1:9"])
    at = time.monotonic()
    body = json.dumps(chat(f"document at {at}")).encode()
    headers = {"x-tokenfleet-class": "long_document"}
    inbound = read_inbound(fleet, fleet.tenants[0], "/v1/chat/completions", body, headers)
    route = RouteRequest(inbound.request_id, inbound.input_tokens, None)
    return inbound, host.arrive(inbound, "dc-a", route, snapshot, at, quotas)
