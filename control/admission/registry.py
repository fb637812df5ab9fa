"""Every admission policy by name: the one list, as ``control.routing.registry`` is for
routers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol

from control.admission.baselines import (
    DynamoRouterQueue,
    Fcfs,
    LitellmPriority,
    LlmdFlowControl,
    MooncakeEarlyReject,
    VllmPriority,
)
from control.admission.request import AdmissionRequest
from control.admission.slomax import SLOMax, SLOMaxParams
from control.admission.view import AdmissionDecision, AdmissionView
from control.routing.snapshot import PoolModel

EngineScheduling = Literal["fcfs", "priority"]
"""How the engines order their own wait queues (vLLM's ``--scheduling-policy``)."""


class Admission(Protocol):
    """Decides whether a request starts now, waits in its class pool, or is refused.

    ``decide`` is synchronous, does no I/O and keeps no state: the host keeps the pools and
    counts and passes them in the view, so a simulator replays it."""

    @property
    def name(self) -> str: ...

    @property
    def wants_prediction(self) -> bool:
        """Whether its decisions read the router's TTFT prediction (the host asks for one
        only then: it costs a second pass of the router's model)."""
        ...

    @property
    def needs_prediction(self) -> bool:
        """Whether it cannot decide without that prediction: it runs only behind a router
        that makes one (``PredictsTtft``; ``control.pipeline.check_pairing``)."""
        ...

    @property
    def release_rate_per_s(self) -> float | None:
        """At most how many held requests a second it lets go, as its dispatch loop ticks
        (None: as many as it allows whenever the host asks)."""
        ...

    @property
    def engine_scheduling(self) -> EngineScheduling:
        """The ``--scheduling-policy`` the engines behind it run with (the host sends each
        request's class priority where it is ``priority``)."""
        ...

    def decide(
        self, request: AdmissionRequest, view: AdmissionView, *, held: bool = False
    ) -> AdmissionDecision: ...


ADMISSIONS: dict[str, Callable[[PoolModel | None], Admission]] = {
    "fcfs": lambda _pool: Fcfs(),
    "vllm_priority": lambda _pool: VllmPriority(),
    "slomax": lambda pool: SLOMax(pool=pool),
    "dynamo_router_queue": lambda _pool: DynamoRouterQueue(),
    "llmd_flow_control": lambda _pool: LlmdFlowControl(),
    "litellm_priority": lambda _pool: LitellmPriority(),
    "mooncake_early_reject": lambda pool: MooncakeEarlyReject(_needs(pool, "mooncake")),
}
"""Every admission policy, one line each, built from the pool's model (for those that
predict with it or, as SLOMax, reserve its engines' sequences)."""


SLOMAX_MECHANISMS = (
    "class_pools",
    "early_rejection",
    "interactive_reservation",
    "interference_bound",
)
"""SLOMax's switchable mechanisms (``SLOMaxParams``)."""


def _slomax_without(mechanism: str) -> Callable[[PoolModel | None], Admission]:
    name = f"slomax_without_{mechanism}"
    return lambda pool: SLOMax(SLOMaxParams(**{mechanism: False}), name=name, pool=pool)


ABLATIONS: dict[str, Callable[[PoolModel | None], Admission]] = {
    **{f"slomax_without_{m}": _slomax_without(m) for m in SLOMAX_MECHANISMS},
    "slomax_without_controller": lambda pool: SLOMax(name="slomax_without_controller", pool=pool),
}
"""SLOMax with one part switched off, each under a name of its own, for the benchmark's
ablation (``tokenfleet bench admission --policies``); gateways are offered the policies
of ``ADMISSIONS`` alone. Without the controller, the limits stay where SLOMax starts."""


def _needs(pool: PoolModel | None, name: str) -> PoolModel:
    if pool is None:
        raise ValueError(f"{name} admission prices queues on the pool's step model")
    return pool


CONTROLLED = frozenset({"slomax", *ABLATIONS} - {"slomax_without_controller"})
"""The policies whose quotas a controller adjusts from the goodput table (SLOMax's,
``control.controllers.slomax``); hosts run the loop beside them."""


def make_admission(
    name: str, pool: PoolModel | None = None, *, ablations: bool = True
) -> Admission:
    """The admission policy ``name``, or KeyError naming the known ones; ``pool`` describes
    the model pool to those that use it; ``ablations``: SLOMax with a part switched off
    counts among them (not on a gateway: without class pools, replicas side by side
    would refuse what their ceiling slots do not cover)."""
    offered = ADMISSIONS | ABLATIONS if ablations else ADMISSIONS
    try:
        build = offered[name]
    except KeyError:
        known = ", ".join(sorted(offered))
        raise KeyError(f"unknown admission policy {name!r}; known: {known}") from None
    return build(pool)
