"""Instance routing: which instance of a model pool serves a request."""

from control.routing.registry import ROUTERS, Router, make_router
from control.routing.snapshot import Candidate, Decision, FleetSnapshot, RouteRequest

__all__ = [
    "ROUTERS",
    "Candidate",
    "Decision",
    "FleetSnapshot",
    "RouteRequest",
    "Router",
    "make_router",
]
