"""A local Redis server for development and tests: Debian's ``redis-server`` on a free
loopback port, nothing persisted.

    tokenfleet redis start     # prints the URL, e.g. redis://127.0.0.1:40124/0
    tokenfleet redis status    # the URL of the running server, or exit 1
    tokenfleet redis stop
"""

from __future__ import annotations

import shutil
import socket
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
    def __init__(self, home: Path, port: int | None = None) -> None:
        self.home = home
        self.port = port or free_port()
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
        self._server.launch(argv, ready=self._answers, timeout_s=timeout_s, detach=detach)
        return self.url

    def stop(self) -> None:
        self._server.terminate()

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False


def running_url(home: Path | None = None) -> str | None:
    return read_address(home or DEFAULT_HOME)
