"""Session-wide real services (under ``CI=true`` a service that cannot be had fails the
run; elsewhere its tests are skipped with the reason), and a port another listener holds."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import pytest

from schemas import Envelope
from schemas.base import TaskClass
from schemas.lifecycle import RequestArrived
from streams.bus import EventBus
from streams.kafka import create_topics
from tests.services import Service, kafka_service, redis_cluster_service, redis_service
from tokenfleet.services.kafka import LocalKafka

T = TypeVar("T")

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}

# The product's settings from the shell that runs the tests (an operator's Kafka and Redis
# among them) reach neither the code under test nor the processes it starts: the tests'
# own services are named apart (``tests/services.py``). Where downloads and data live
# stays (the Kafka jars ``./dev test`` fetched, the traces).
_KEPT = ("TOKENFLEET_TEST_", "TOKENFLEET_CACHE", "TOKENFLEET_TRACES", "TOKENFLEET_CALIBRATION")
for _setting in [name for name in os.environ if name.startswith("TOKENFLEET_")]:
    if not _setting.startswith(_KEPT):
        del os.environ[_setting]
_USED: list[Service] = []


def _provide(
    factory: contextlib.AbstractContextManager[Service], stack: contextlib.ExitStack
) -> Service:
    try:
        service = stack.enter_context(factory)
    except Exception as exc:
        unavailable(exc)
    _USED.append(service)
    return service


def unavailable(reason: object) -> NoReturn:
    """Fail under CI (a missing service is a broken setup), skip with the reason elsewhere."""
    message = f"service unavailable: {reason}"
    if IN_CI:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port that a listener holds for the test's duration."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[LocalKafka]:
    """A broker of this test's own, for tests that stop and start it."""
    broker = LocalKafka(tmp_path / "broker")
    try:
        broker.start()
    except Exception as exc:
        broker.stop()
        unavailable(exc)
    _USED.append(Service("kafka", broker.bootstrap, "a test's own local broker"))
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """A real broker with the catalog's topics created."""
    with contextlib.ExitStack() as stack:
        service = _provide(kafka_service(tmp_path_factory.mktemp("kafka")), stack)
        run_in_thread(create_topics(service.address))
        yield service


@contextlib.contextmanager
def own_broker_for_module(home: Path) -> Iterator[Service]:
    """A broker for one test module alone (unless the environment gives one), its topics
    created: for modules whose worker reads every input topic from its start, where the
    other tests' events would only slow it down."""
    with contextlib.ExitStack() as stack:
        try:
            service = stack.enter_context(kafka_service(home))
        except Exception as exc:
            unavailable(exc)
        run_in_thread(create_topics(service.address))
        yield service


async def read_for(bus: EventBus, topic: str, seconds: float) -> list[object]:
    """The payloads on ``topic`` from its start that arrive within ``seconds``."""
    out: list[object] = []

    async def read() -> None:
        async with bus.subscribe(topic, "earliest") as events:
            async for event in events:
                out.append(event.envelope.payload)

    reader = asyncio.create_task(read())
    await asyncio.sleep(seconds)
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)
    return out


def run_in_thread(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion on a fresh loop, also when called inside a running one."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with contextlib.ExitStack() as stack:
        yield _provide(redis_service(tmp_path_factory.mktemp("redis")), stack)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with contextlib.ExitStack() as stack:
        yield _provide(redis_cluster_service(tmp_path_factory.mktemp("redis-cluster")), stack)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for service in _USED:
        terminalreporter.write_line(f"real service used: {service.describe()}")


def huge_arrival(request_id: str) -> Envelope:
    """An arrival whose prompt lists over a megabyte of prefix blocks."""
    arrived = RequestArrived(
        request_id=request_id,
        tenant="t",
        task_class=TaskClass.INTERACTIVE,
        model="m",
        input_tokens=1_000_000,
        output_budget=1,
        prefix_blocks=tuple(range(2**62, 2**62 + 60_000)),
        source_region="eu-west",
    )
    return Envelope.wrap(arrived, source="test")
