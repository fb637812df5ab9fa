"""What a DC policy sees: the data centers that serve one model, as the edge last heard of
them, and one request; and what it answers: the DCs to try, in order, with its reasons.

The hard filters live here too, because every policy applies them, baselines included:
an operator configures any load balancer with only the places a request may go.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

DEFAULT_RTT_S = 0.05
"""The round trip assumed between two regions the fleet file does not name: a
transcontinental path is 70 to 150 ms, one within a continent 10 to 40; a DC in another
region than the client's should cost something even unmeasured."""


@dataclass(frozen=True)
class DataCenterState:
    """One DC's pool of the request's model, as of the edge's last tables."""

    name: str
    region: str
    ready_instances: int = 0
    ready_versions: frozenset[str] = frozenset()
    """The model versions with a ready instance here."""
    versions: frozenset[str] = frozenset()
    """The model versions deployed here, ready or not."""
    utilisation: float = 0.0
    """Demand over capacity lately (0 idle, 1 at capacity, more past it)."""
    predicted_wait_s: float = 0.0
    """How long a new request would wait here behind the work in flight (its backlog)."""
    weight: float | None = None
    """The controller's routing weight for the DC (None: none published)."""
    warm_tokens: int = 0
    """How much of the request's prompt ran here lately: KV the DC likely still holds."""
    class_room: float | None = None
    """The share of the request's class's concurrency limit here still free (None: the
    class has no limit here): a DC whose admission holds the class back has no room."""
    instances: int = 0
    """Instances of the model configured here, ready or not."""
    inflight_requests: float = 0.0
    """Requests sent here and not finished, as the edge counts them."""
    kv_use: float = 0.0
    """The pool's mean share of KV blocks in use."""
    queue: float = 0.0
    """The pool's mean requests waiting per instance."""

    @property
    def healthy_share(self) -> float:
        return self.ready_instances / self.instances if self.instances else 0.0


@dataclass(frozen=True)
class FleetState:
    dcs: tuple[DataCenterState, ...]
    round_trips_s: Mapping[tuple[str, str], float] = field(default_factory=dict)
    """Round trips by (region, region); pairs not named cost ``DEFAULT_RTT_S``."""

    def rtt_s(self, source: str, target: str) -> float:
        if source == target:
            return 0.0
        return self.round_trips_s.get((source, target), DEFAULT_RTT_S)

    def nearest_first(
        self, source: str, dcs: list[DataCenterState] | tuple[DataCenterState, ...]
    ) -> list[DataCenterState]:
        """``dcs`` by round trip from ``source``, ties in fleet order."""
        return sorted(dcs, key=lambda dc: self.rtt_s(source, dc.region))


@dataclass(frozen=True)
class DcRequest:
    request_id: str
    source_region: str
    """Where the client's request entered the fleet."""
    source_dc: str | None = None
    """The DC whose gateway took the request, preferred among equals (None: none)."""
    input_tokens: int = 0
    tenant_dcs: frozenset[str] | None = None
    """The DCs the tenant may use (None: every DC)."""
    residency: frozenset[str] = frozenset()
    """The regions the request may run in (empty: any)."""
    version: str | None = None
    """The model version it must run on (None: any ready one)."""
    draw: float = 0.0
    """A uniform draw in [0, 1) from the host, for policies that split traffic at random."""


@dataclass(frozen=True)
class DcDecision:
    policy: str
    order: tuple[str, ...]
    """The DCs to try, best first: the first, then the fallback if it fails before the
    first token. Empty: no DC may run the request."""
    excluded: Mapping[str, str] = field(default_factory=dict)
    """Each DC the hard filters took out, and why (``permission``, ``residency``,
    ``not_deployed``, ``not_ready``)."""
    costs: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    """Each candidate's cost and its parts, where the policy prices candidates."""

    @property
    def chosen(self) -> str | None:
        return self.order[0] if self.order else None


def admissible(
    request: DcRequest, fleet: FleetState
) -> tuple[list[DataCenterState], dict[str, str]]:
    """The DCs the request may run in, and why each other one may not: the tenant's
    permission, the request's residency, the model (and version) deployed there, and
    ready there while some other such DC has it ready. Where none has, the DCs it is
    deployed in stay: an instance cooling down after a failure, or restarting, is a
    gap the DC's own admission rides out (holding the request), not a refusal."""
    deployed: list[DataCenterState] = []
    excluded: dict[str, str] = {}
    for dc in fleet.dcs:
        if request.tenant_dcs is not None and dc.name not in request.tenant_dcs:
            excluded[dc.name] = "permission"
        elif request.residency and dc.region not in request.residency:
            excluded[dc.name] = "residency"
        elif dc.instances == 0 or (
            request.version is not None and request.version not in dc.versions
        ):
            excluded[dc.name] = "not_deployed"
        else:
            deployed.append(dc)
    ready = [dc for dc in deployed if _ready_for(dc, request.version)]
    if not ready:
        return deployed, excluded
    excluded |= {dc.name: "not_ready" for dc in deployed if dc not in ready}
    return ready, excluded


def _ready_for(dc: DataCenterState, version: str | None) -> bool:
    return dc.ready_instances > 0 and (version is None or version in dc.ready_versions)
