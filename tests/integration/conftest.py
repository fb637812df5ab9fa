"""Fixtures of the gateway tests: two emulated instances, a gateway before them, and the
official openai client pointed at it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest

from sim.emulator.server import EmulatedInstance
from tests.gateway_harness import KEY, Gateway, emulated, fleet_for, gateway


@pytest.fixture
async def instances() -> AsyncIterator[list[EmulatedInstance]]:
    async with emulated(2) as running:
        yield running


@pytest.fixture
async def front(instances: list[EmulatedInstance]) -> AsyncIterator[Gateway]:
    async with gateway(fleet_for([i.url for i in instances])) as running:
        yield running


@pytest.fixture
async def client(front: Gateway) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key=KEY) as client:
        yield client
