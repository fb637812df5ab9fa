"""Standby GPUs on the emulator: placed replicas start after their warm-up, replicas taken
back stop, and only a newer, unexpired placement for the emulator's own DC moves them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from control.controllers.placement import PlacementController, PlacementParams
from schemas.control import PlacementAction, PlacementRecommendation
from schemas.fleet import InstanceConfig
from sim.emulator.standby import StandbyReplicas

WARMUP_S = 0.2
LOCAL = {"b-0", "b-1", "b-2"}
INSTANCES = [
    InstanceConfig(id="b-0", dc="dc-b", url="http://127.0.0.1:1", model="m"),
    InstanceConfig(id="b-1", dc="dc-b", url="http://127.0.0.1:2", model="m", standby=True),
    InstanceConfig(id="b-2", dc="dc-b", url="http://127.0.0.1:3", model="m", standby=True),
]


class Servers:
    """Records what the replicas serve: the instances listening now, and every start."""

    def __init__(self) -> None:
        self.listening: set[str] = set()
        self.starts: list[str] = []

    @contextlib.asynccontextmanager
    async def serve(self, instance: InstanceConfig) -> AsyncIterator[None]:
        self.listening.add(instance.id)
        self.starts.append(instance.id)
        try:
            yield
        finally:
            self.listening.discard(instance.id)


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def placement(
    target: int, version: int, dc: str = "dc-b", ttl_s: float = 600.0
) -> PlacementRecommendation:
    action = PlacementAction(model="m", model_version="1", dc=dc, target_replicas=target)
    controller = PlacementController(PlacementParams(ttl_s=ttl_s))
    return controller.snapshot(dc, [action], version, Clock.now)


async def test_a_placed_replica_listens_only_after_its_warm_up_and_stops_when_taken_back() -> None:
    servers = Servers()
    standby = StandbyReplicas(INSTANCES, LOCAL, servers.serve, WARMUP_S, Clock())
    async with standby.running():
        standby.apply(placement(3, version=1))
        await asyncio.sleep(WARMUP_S / 2)
        assert servers.listening == set()  # still loading the model
        await asyncio.sleep(WARMUP_S)
        assert servers.listening == {"b-1", "b-2"}
        standby.apply(placement(2, version=2))  # one back: the last placed goes
        await asyncio.sleep(0.01)
        assert servers.listening == {"b-1"}
    assert servers.listening == set()  # the emulator stopping stops its replicas


async def test_a_replica_taken_back_during_its_warm_up_never_starts() -> None:
    servers = Servers()
    standby = StandbyReplicas(INSTANCES, LOCAL, servers.serve, WARMUP_S, Clock())
    async with standby.running():
        standby.apply(placement(2, version=1))
        await asyncio.sleep(WARMUP_S / 2)
        standby.apply(placement(1, version=2))
        await asyncio.sleep(WARMUP_S)
        assert servers.starts == []


async def test_only_a_newer_unexpired_placement_for_its_own_dc_moves_it() -> None:
    servers = Servers()
    clock = Clock()
    standby = StandbyReplicas(INSTANCES, LOCAL, servers.serve, 0.0, clock)
    async with standby.running():
        standby.apply(placement(2, version=5))
        standby.apply(placement(1, version=4))  # older: read late, ignored
        standby.apply(placement(1, version=6, dc="dc-c"))  # another DC's
        clock.now += 700
        standby.apply(placement(1, version=7))  # past its TTL: the demand it sized is gone
        await asyncio.sleep(0.05)
        assert servers.listening == {"b-1"}
        standby.apply(placement(1, version=8, ttl_s=900))
        await asyncio.sleep(0.01)
        assert servers.listening == set()


async def test_a_controller_started_again_is_followed_once_the_placement_in_force_expired() -> None:
    """Its versions start again from 1: below the one in force, which stays applied past
    its TTL, it would be ignored until the emulator restarted."""
    servers = Servers()
    clock = Clock()
    standby = StandbyReplicas(INSTANCES, LOCAL, servers.serve, 0.0, clock)
    async with standby.running():
        standby.apply(placement(2, version=40))
        await asyncio.sleep(0.01)
        standby.apply(placement(1, version=1))  # while version 40 is live: a replay
        await asyncio.sleep(0.01)
        assert servers.listening == {"b-1"}
        clock.now += 700  # version 40 expired; it stays applied
        restarted = placement(1, version=1).model_copy(update={"issued_at": clock.now})
        standby.apply(restarted)
        await asyncio.sleep(0.01)
        assert servers.listening == set()


async def test_a_replica_that_failed_to_start_starts_again_at_the_next_placement() -> None:
    servers, failing = Servers(), {"b-1"}

    @contextlib.asynccontextmanager
    async def serve(instance: InstanceConfig) -> AsyncIterator[None]:
        if instance.id in failing:
            failing.discard(instance.id)
            raise OSError("address already in use")
        async with servers.serve(instance):
            yield

    standby = StandbyReplicas(INSTANCES, LOCAL, serve, 0.0, Clock())
    async with standby.running():
        standby.apply(placement(2, version=1))
        await asyncio.sleep(0.05)
        assert servers.listening == set()
        standby.apply(placement(2, version=2))  # the renewal
        await asyncio.sleep(0.05)
        assert servers.listening == {"b-1"}
