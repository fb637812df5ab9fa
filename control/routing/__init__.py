"""Instance routing: which instance of a model pool serves a request."""

from control.routing.registry import (
    ROUTERS,
    FollowsRequests,
    Learner,
    PredictsTtft,
    ReadsKvEvents,
    Router,
    Withdrawing,
    implements,
    make_router,
    policy_params,
)
from control.routing.snapshot import (
    Candidate,
    Decision,
    FleetSnapshot,
    KvEvent,
    Observation,
    PoolModel,
    RouteRequest,
    TtftPrediction,
)

__all__ = [
    "ROUTERS",
    "Candidate",
    "Decision",
    "FleetSnapshot",
    "FollowsRequests",
    "KvEvent",
    "Learner",
    "Observation",
    "PoolModel",
    "PredictsTtft",
    "ReadsKvEvents",
    "RouteRequest",
    "Router",
    "TtftPrediction",
    "Withdrawing",
    "implements",
    "make_router",
    "policy_params",
]
