"""A local Redis server for development and tests: Debian's ``redis-server`` on a free
loopback port, nothing persisted.

    tokenfleet redis start     # prints the URL, e.g. redis://127.0.0.1:40124/0
    tokenfleet redis status    # the URL of the running server, or exit 1
    tokenfleet redis stop

``LocalRedisCluster`` starts three such servers as one Redis Cluster (no replicas), for
the tests that the shared state's scripts run there.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from tokenfleet.services.process import (
    CACHE,
    ServerProcess,
    ServiceError,
    free_port,
    read_address,
)

DEFAULT_HOME = CACHE / "run" / "redis"


class LocalRedis:
    def __init__(self, home: Path, port: int | None = None, *, cluster: bool = False) -> None:
        """``cluster``: start it as a Redis Cluster node (``LocalRedisCluster`` joins them)."""
        self.home = home
        self.port = port or free_port()
        self.cluster = cluster
        self._server = ServerProcess(home, self.url)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, *, detach: bool = False, timeout_s: float = 20.0) -> str:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not Path(binary).exists():
            raise ServiceError("redis-server is missing; install Debian's redis-server package")
        argv = [
            binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.home),
        ]
        if self.cluster:
            argv += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            # by default the cluster bus listens 10,000 above the port, past 65535 for many
            argv += ["--cluster-port", str(free_port())]
        self._server.launch(argv, ready=self._answers, timeout_s=timeout_s, detach=detach)
        return self.url

    def stop(self) -> None:
        self._server.terminate()

    def _answers(self) -> bool:
        return _ask(self.port, b"PING").startswith(b"+PONG")


class LocalRedisCluster:
    """Three cluster nodes on loopback, their 16,384 hash slots split between them."""

    def __init__(self, home: Path, nodes: int = 3) -> None:
        self.nodes = [LocalRedis(home / f"node-{n}", cluster=True) for n in range(nodes)]

    @property
    def url(self) -> str:
        """One node's address; a cluster client finds the others from it."""
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    def start(self, timeout_s: float = 20.0) -> str:
        try:
            for node in self.nodes:
                node.start(timeout_s=timeout_s)
            self._join(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.url

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def _join(self, timeout_s: float) -> None:
        cli = shutil.which("redis-cli") or "/usr/bin/redis-cli"
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        created = subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if created.returncode != 0:
            raise ServiceError(f"redis-cli --cluster create failed:\n{created.stdout[-2000:]}")
        deadline = time.monotonic() + timeout_s
        while not all(self._state_ok(node.port) for node in self.nodes):
            if time.monotonic() > deadline:
                raise ServiceError(f"the cluster at {self.url} did not settle in {timeout_s} s")
            time.sleep(0.2)

    @staticmethod
    def _state_ok(port: int) -> bool:
        """Whether the node sees every slot served (``cluster_state:ok``)."""
        return b"cluster_state:ok" in _ask(port, b"CLUSTER INFO")


def _ask(port: int, command: bytes) -> bytes:
    """The start of a local server's reply to ``command``; empty when it does not answer."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(command + b"\r\n")
            return sock.recv(4096)
    except OSError:
        return b""


def running_url(home: Path | None = None) -> str | None:
    return read_address(home or DEFAULT_HOME)
