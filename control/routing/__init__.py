"""Instance routing: which instance of a model pool serves a request."""

from control.routing.registry import (
    ROUTERS,
    Learner,
    Router,
    Withdrawing,
    implements,
    make_router,
)
from control.routing.snapshot import (
    Candidate,
    Decision,
    FleetSnapshot,
    Observation,
    PoolModel,
    RouteRequest,
)

__all__ = [
    "ROUTERS",
    "Candidate",
    "Decision",
    "FleetSnapshot",
    "Learner",
    "Observation",
    "PoolModel",
    "RouteRequest",
    "Router",
    "Withdrawing",
    "implements",
    "make_router",
]
