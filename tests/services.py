"""Where the tests' Kafka and Redis come from, in this order:

1. an address from the environment (``TOKENFLEET_TEST_KAFKA_BOOTSTRAP``,
   ``TOKENFLEET_TEST_REDIS_URL``: not the ``TOKENFLEET_KAFKA_BOOTSTRAP`` and
   ``TOKENFLEET_REDIS_URL`` an operator's shell exports for the product, which the tests
   would fill with their topics, events and keys; ``tests/conftest.py`` takes every
   ``TOKENFLEET_`` setting but these out of the tests' environment);
2. testcontainers, when a Docker engine answers;
3. the project's own local broker / server (``tokenfleet.services``).

A Redis Cluster always comes from the last: three local ``redis-server`` nodes.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from tokenfleet.services.kafka import KAFKA_VERSION, LocalKafka
from tokenfleet.services.redis import LocalRedis, LocalRedisCluster

KAFKA_VARIABLE = "TOKENFLEET_TEST_KAFKA_BOOTSTRAP"
REDIS_VARIABLE = "TOKENFLEET_TEST_REDIS_URL"


@dataclass(frozen=True)
class Service:
    name: str
    address: str
    origin: str

    def describe(self) -> str:
        return f"{self.name} at {self.address} ({self.origin})"


def docker_answers(timeout_s: float = 2.0) -> bool:
    """Whether a Docker engine answers ``GET /_ping`` at ``DOCKER_HOST`` or the default
    socket. (docker-py's own probe leaks its socket when no engine is there.)"""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    url = urlsplit(host)
    try:
        if url.scheme == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout_s)
            with sock:
                sock.connect(url.path)
                return _pings(sock)
        with socket.create_connection((url.hostname, url.port or 2375), timeout_s) as sock:
            return _pings(sock)
    except OSError:
        return False


def _pings(sock: socket.socket) -> bool:
    sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
    status_line = sock.recv(64).split(b"\r\n", 1)[0]
    return status_line.split(b" ")[1:2] == [b"200"]


@contextlib.contextmanager
def kafka_service(home: Path) -> Iterator[Service]:
    if address := os.environ.get(KAFKA_VARIABLE):
        yield Service("kafka", address, KAFKA_VARIABLE)
    elif docker_answers():
        from testcontainers.community.kafka import KafkaContainer

        with KafkaContainer().with_kraft() as container:
            yield Service("kafka", container.get_bootstrap_server(), "testcontainers")
    else:
        broker = LocalKafka(home)
        try:
            yield Service("kafka", broker.start(), f"local KRaft broker, Kafka {KAFKA_VERSION}")
        finally:
            broker.stop()


@contextlib.contextmanager
def redis_service(home: Path) -> Iterator[Service]:
    if url := os.environ.get(REDIS_VARIABLE):
        yield Service("redis", url, REDIS_VARIABLE)
    elif docker_answers():
        from testcontainers.community.redis import RedisContainer

        with RedisContainer() as container:
            host, port = container.get_container_host_ip(), container.get_exposed_port(6379)
            yield Service("redis", f"redis://{host}:{port}/0", "testcontainers")
    else:
        server = LocalRedis(home)
        try:
            yield Service("redis", server.start(), "local redis-server")
        finally:
            server.stop()


@contextlib.contextmanager
def redis_cluster_service(home: Path) -> Iterator[Service]:
    cluster = LocalRedisCluster(home)
    try:
        yield Service("redis cluster", cluster.start(), "three local redis-server nodes")
    finally:
        cluster.stop()
