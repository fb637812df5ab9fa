"""Every admission policy by name: the one list, as ``control.routing.registry`` is for
routers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from control.admission.baselines import DynamoRouterQueue, LlmdFlowControl
from control.admission.request import AdmissionRequest
from control.admission.slomax import SLOMax
from control.admission.view import AdmissionDecision, AdmissionView, Verdict


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
    def release_rate_per_s(self) -> float | None:
        """At most how many held requests a second it lets go, as its dispatch loop ticks
        (None: as many as it allows whenever the host asks)."""
        ...

    def decide(
        self, request: AdmissionRequest, view: AdmissionView, *, held: bool = False
    ) -> AdmissionDecision: ...


@dataclass(frozen=True)
class Fcfs:
    """Admit everything: the engines' own first-come-first-served queues decide, as vLLM's
    default ``--scheduling-policy fcfs`` does behind a gateway with no admission."""

    name: str = "fcfs"
    wants_prediction: bool = False
    release_rate_per_s: float | None = None

    def decide(
        self, request: AdmissionRequest, view: AdmissionView, *, held: bool = False
    ) -> AdmissionDecision:
        return AdmissionDecision(Verdict.DISPATCH, "admitted")


ADMISSIONS: dict[str, Callable[[], Admission]] = {
    "fcfs": Fcfs,
    "slomax": SLOMax,
    "dynamo_router_queue": DynamoRouterQueue,
    "llmd_flow_control": LlmdFlowControl,
}
"""Every admission policy, one line each."""

CONTROLLED = frozenset({"slomax"})
"""The policies whose quotas a controller adjusts from the goodput table (SLOMax's,
``control.controllers.slomax``); hosts run the loop beside them."""


def make_admission(name: str) -> Admission:
    """The admission policy ``name``, or KeyError naming the known ones."""
    try:
        return ADMISSIONS[name]()
    except KeyError:
        known = ", ".join(sorted(ADMISSIONS))
        raise KeyError(f"unknown admission policy {name!r}; known: {known}") from None
