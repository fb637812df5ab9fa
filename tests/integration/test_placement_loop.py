"""FleetMind's long cycle on the live path, on a real broker: ``tokenfleet controller``
reads a DC's tables, places a replica on its standby GPU (``tf.control.placement``), and
``tokenfleet emulate --placement`` starts it after its warm-up; the collector scrapes it
and the DC's gateway sends it requests; once the DC runs cold the controller takes the
replica back and its port closes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from schemas import Envelope
from schemas.base import TaskClass
from schemas.control import PlacementRecommendation
from schemas.tables import GoodputTable
from streams.kafka import KafkaBus
from tests.services import Service
from tests.unit.test_quota_controller import capacity, row
from tokenfleet.deployment import Deployment, Part
from tokenfleet.services.process import free_ports

pytestmark = pytest.mark.kafka

LONG_CYCLE_S = 1.0
"""The controller's long cycle: a DC moves at most once per two."""
WARMUP_S = 3.0
RPS_PER_INSTANCE = 2.0
BOUND_S = 30.0
"""From the tables calling for a move to the replica listening (or gone): the parts'
first reads of the topics, two cycles, and the warm-up."""


@dataclass
class Tables:
    """What the test's stand-in for the table worker publishes for the DC, every 0.3 s."""

    dc: str
    ended_rps: float
    ready: int

    async def publish(self, bus: KafkaBus) -> None:
        while True:
            now = time.time()
            version = int(now * 1000)
            ended = row(TaskClass.INTERACTIVE, round(self.ended_rps * 10), 0)
            goodput = GoodputTable(
                dc=self.dc,
                version=version,
                window_start=now - 10,
                window_end=now,
                classes=(ended,),
                tenants=(),
            )
            serving = capacity(self.ready, now).model_copy(
                update={"dc": self.dc, "version": version}
            )
            await bus.publish_events([Envelope.wrap(t, source="test") for t in (goodput, serving)])
            await asyncio.sleep(0.3)


async def placements(bus: KafkaBus, dc: str, target: int) -> PlacementRecommendation:
    """The first placement for ``dc`` that runs ``target`` replicas."""
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        latest = (await bus.read_latest("tf.control.placement")).get(dc)
        placed = latest.payload if latest is not None else None
        if (
            isinstance(placed, PlacementRecommendation)
            and placed.actions[0].target_replicas == target
        ):
            return placed
        await asyncio.sleep(0.2)
    raise AssertionError(f"no placement of {target} replicas for {dc} within {BOUND_S} s")


async def served_by(gateway: str, chats: int = 6) -> set[str]:
    """The instances that answered ``chats`` chats sent at once through ``gateway``."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
    auth = {"authorization": "Bearer sk-t"}
    async with httpx.AsyncClient(base_url=gateway, headers=auth, timeout=60.0) as http:
        sent = [http.post("/v1/chat/completions", json=chat) for _ in range(chats)]
        answered = await asyncio.gather(*sent)
    assert [a.status_code for a in answered] == [200] * chats
    return {a.headers["x-tokenfleet-instance"] for a in answered}


async def until_served_by(gateway: str, instance: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while instance not in await served_by(gateway):
        assert time.monotonic() < deadline, f"{instance} took no request in {BOUND_S} s"


async def answers(url: str) -> bool:
    try:
        async with httpx.AsyncClient(timeout=1.0) as http:
            return (await http.get(f"{url}/health")).status_code == 200
    except httpx.TransportError:
        return False


async def until(url: str, listening: bool) -> float:
    """When ``url`` first answers (or stops answering), polled every 0.1 s."""
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        if await answers(url) == listening:
            return time.time()
        await asyncio.sleep(0.1)
    raise AssertionError(f"{url} still {'down' if listening else 'up'} after {BOUND_S} s")


@contextlib.asynccontextmanager
async def deployed(kafka: Service, tmp_path: Path, dc: str) -> AsyncIterator[list[str]]:
    """The DC's emulator following placements, the controller, the collector and the
    DC's gateway, as processes; yields the base instance's URL, the standby one's and
    the gateway's."""
    ports = free_ports(4)
    urls = [f"http://127.0.0.1:{ports + n}" for n in range(3)]
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(
        f'version = 1\n[[dcs]]\nname = "{dc}"\nregion = "r"\n'
        f'[[models]]\nname = "m"\nprofile = "llama3-70b-4xh100"\n'
        f"rps_per_instance = {RPS_PER_INSTANCE}\n"
        f'[[instances]]\nid = "{dc}-0"\ndc = "{dc}"\nurl = "{urls[0]}"\nmodel = "m"\n'
        f'[[instances]]\nid = "{dc}-1"\ndc = "{dc}"\nurl = "{urls[1]}"\nmodel = "m"\n'
        'standby = true\n[[tenants]]\nname = "t"\napi_keys = ["sk-t"]\n'
    )
    fleet_args = ("--fleet", str(fleet))
    cycle = ("--period", "1", "--ttl", "3", "--long-cycle", f"{LONG_CYCLE_S:g}")
    placed = ("--placement", "--warmup", f"{WARMUP_S:g}")
    controller = f"http://127.0.0.1:{ports + 3}"
    parts = [  # the controller last: it places nothing before the rest is up
        Part("emulate", ("emulate", *fleet_args, *placed), urls[0], (f"{urls[0]}/health",)),
        Part("collector", ("collect", *fleet_args)),
        Part(
            "gateway",
            ("gateway", *fleet_args, "--dc", dc, "--port", str(ports + 2)),
            urls[2],
            (f"{urls[2]}/health",),
        ),
        Part(
            "controller",
            ("controller", *fleet_args, *cycle, "--port", str(ports + 3)),
            controller,
            (f"{controller}/health",),
        ),
    ]
    deployment = Deployment(tmp_path / "up")
    env = os.environ | {"TOKENFLEET_KAFKA_BOOTSTRAP": kafka.address}
    await asyncio.to_thread(deployment.start, parts, env)
    try:
        yield urls
    finally:
        await asyncio.to_thread(deployment.stop)
        for part in parts:
            log = deployment.home / part.name / "server.log"
            print(f"--- {part.name}\n{log.read_text(errors='replace')[-1500:]}")


async def test_a_hot_dc_gets_a_replica_after_its_warm_up_and_a_cold_one_gives_it_back(
    kafka: Service, tmp_path: Path
) -> None:
    dc = f"dc-{uuid.uuid4().hex[:8]}"  # the session's broker: tables of its own
    tables = Tables(dc, ended_rps=0.2, ready=1)  # cold while it deploys: nothing placed
    bus = KafkaBus(kafka.address, source="test")
    publisher = asyncio.create_task(tables.publish(bus))
    try:
        async with deployed(kafka, tmp_path, dc) as (base, spare, gateway):
            assert await answers(base)
            assert not await answers(spare)
            assert await served_by(gateway) == {f"{dc}-0"}
            tables.ended_rps = 3.0  # 1.5 of its one replica's rate
            grown = await placements(bus, dc, 2)
            started_at = await until(spare, listening=True)
            assert started_at - grown.issued_at >= WARMUP_S  # it loaded before it listened
            await until_served_by(gateway, f"{dc}-1")  # scraped, ready, chosen
            tables.ready, tables.ended_rps = 2, 0.2  # it serves, and the demand is gone
            await placements(bus, dc, 1)
            await until(spare, listening=False)
            assert await answers(base)  # the base deployment stays
    finally:
        publisher.cancel()
        await asyncio.gather(publisher, return_exceptions=True)
        await bus.close()
