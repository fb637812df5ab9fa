"""Starting, finding and stopping a local server process that outlives its caller if asked.

A server's home folder holds its ``pid`` and ``address`` files, so another process (the
CLI's ``stop`` or ``status``) can find it.
"""

from __future__ import annotations

import contextlib
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path

CACHE = Path(os.environ.get("TOKENFLEET_CACHE", Path.home() / ".cache" / "tokenfleet"))
"""Downloads and default run folders live here, outside the work tree."""


STOP_TIMEOUT_S = 30.0
"""How long a server gets to exit after SIGTERM before it is killed (SIGKILL)."""


class ServiceError(RuntimeError):
    """A local service could not be set up, started or reached."""


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10_000
_RANDOM = random.SystemRandom()
"""Not the ``random`` module's state, which forked processes share and draw alike."""
_HANDED_OUT: set[int] = set()
"""Ports this process has handed out: free when checked, but maybe not yet bound."""


def free_port() -> int:
    return free_ports(1)


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports that are all free now, for a server that
    takes a base port (``tokenfleet emulate``). Drawn below the kernel's ephemeral range
    where it is known: a port from that range, free when checked, can be taken by the
    local end of any outgoing connection before the server binds it (seen: a gateway of
    ``tokenfleet up``'s test failed to start, its port taken)."""
    while True:
        base = _candidate(count)
        ports = range(base, base + count)
        if ports[-1] > 65535 or _HANDED_OUT.intersection(ports):
            continue
        with contextlib.ExitStack() as held:
            try:
                for port in ports:
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:  # one is taken: try another base
                continue
        _HANDED_OUT.update(ports)
        return base


def _candidate(count: int) -> int:
    """A base port to try: at random below the ephemeral range, else one the kernel picks."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
        if ephemeral_low - count > LOWEST_PORT:
            return _RANDOM.randrange(LOWEST_PORT, ephemeral_low - count + 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def python_module(module: str) -> list[str]:
    """The command line that runs ``module`` with this Python. ``-P`` leaves the working
    folder off the child's ``sys.path``: the project's top-level packages have generic
    names (``schemas``, ``control``), which a folder of the operator's own would shadow."""
    return [sys.executable, "-P", "-m", module]


class ServerProcess:
    """One server process whose output goes to ``home/server.log``, after a header line
    per launch (the log is appended to, run after run)."""

    def __init__(self, home: Path, address: str) -> None:
        self.home = home
        self.address = address
        self._process: subprocess.Popen[bytes] | None = None
        self._log_start = 0
        """Where this launch's header begins in the log: a failed launch's tail is its
        own output, never an earlier run's."""

    @property
    def log_path(self) -> Path:
        return self.home / "server.log"

    def launch(
        self,
        argv: Sequence[str],
        *,
        ready: Callable[[], bool],
        timeout_s: float,
        detach: bool = False,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """Start the process and poll ``ready`` until it answers; ``detach`` lets it
        outlive this one (for the CLI); ``env`` replaces the inherited environment.
        Raises with the log's tail if it exits or times out.
        """
        self._spawn(argv, detach, env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                self.terminate()  # forget its pid and address files
                raise ServiceError(f"{self.address} exited early; log tail:\n{self._log_tail()}")
            if ready():
                return
            time.sleep(0.2)
        self.terminate()
        raise ServiceError(
            f"{self.address} did not answer within {timeout_s:.0f} s; log tail:\n{self._log_tail()}"
        )

    def _log_tail(self) -> str:
        with self.log_path.open("rb") as log:
            log.seek(self._log_start)
            return log.read().decode(errors="replace")[-2000:]

    def _spawn(self, argv: Sequence[str], detach: bool, env: Mapping[str, str] | None) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._log_start = log.tell()
            self._process = subprocess.Popen(
                list(argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=detach,
                env=env,
            )
            pid = self._process.pid
            # Once the pid is known: the child, just started, has seldom written yet (the
            # tail reads from _log_start, before the header, either way).
            log.write(_log_header(pid, argv).encode())
        (self.home / "pid").write_text(f"{pid} {_started_at(pid) or ''}".strip())
        (self.home / "address").write_text(self.address)

    def terminate(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop the process: SIGTERM, then SIGKILL if it runs ``timeout_s`` later."""
        self.request_stop()
        self.wait_stopped(timeout_s)

    def request_stop(self) -> None:
        """Send the process SIGTERM without waiting, so that several can stop at once
        (``wait_stopped`` next)."""
        pid = self._pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    def wait_stopped(self, timeout_s: float) -> None:
        """Wait for the process to exit after ``request_stop``, SIGKILL it once
        ``timeout_s`` has passed; forget its pid and address files."""
        pid = self._pid()
        if pid is not None:
            _wait_or_kill(pid, self._running(pid), timeout_s)
        self._process = None
        for name in ("pid", "address"):
            (self.home / name).unlink(missing_ok=True)

    def _pid(self) -> int | None:
        return self._process.pid if self._process else read_pid(self.home)

    def _running(self, pid: int) -> Callable[[], bool]:
        """Whether ``pid`` still runs: this one's child by its handle; another's by its
        pid file, which also checks that the id still names the process it started (a
        long drain gives the system time to reuse the id, and the process then killed
        would be another's)."""
        process = self._process
        if process is not None:
            return lambda: process.poll() is None
        return lambda: read_pid(self.home) == pid


def _log_header(pid: int, argv: Sequence[str]) -> str:
    started = datetime.now(UTC).isoformat(timespec="seconds")
    return f"--- started {started} pid {pid}: {shlex.join(argv)} ---\n"


@contextlib.contextmanager
def http_service(
    home: Path,
    argv: Sequence[str],
    url: str,
    *,
    health: str = "/health",
    env: Mapping[str, str] | None = None,
    timeout_s: float = 120.0,
) -> Iterator[str]:
    """Run ``argv`` as a child process serving HTTP at ``url`` while the block runs: it is
    up once ``url + health`` answers 200; it is stopped on the way out."""
    server = ServerProcess(home, url)
    server.launch(argv, ready=lambda: answers_http(url + health), timeout_s=timeout_s, env=env)
    try:
        yield url
    finally:
        server.terminate()


def running_for(seconds: float) -> Callable[[], bool]:
    """A readiness check for a server with nothing to ask: true once ``seconds`` have
    passed, by which time ``launch`` has seen that the process has not exited."""
    deadline = time.monotonic() + seconds
    return lambda: time.monotonic() >= deadline


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""Local services are asked directly, whatever proxy the environment names."""


def read_http(url: str, timeout_s: float = 10.0) -> str:
    """The body a local service answers at ``url``."""
    with _DIRECT.open(url, timeout=timeout_s) as response:
        body: bytes = response.read()
        return body.decode()


def answers_http(url: str, timeout_s: float = 1.0) -> bool:
    try:
        with _DIRECT.open(url, timeout=timeout_s) as response:
            status: int = response.status
            return status == 200
    except (urllib.error.URLError, OSError):
        return False


def read_pid(home: Path) -> int | None:
    """The process id in ``home/pid`` while that process runs. The file also holds when
    the process started (where ``/proc`` tells): after a reboot, or once the process has
    ended and the system reused its id, the id names another process, which must not be
    taken for it (``down`` would stop it)."""
    try:
        pid_text, _, started = (home / "pid").read_text().partition(" ")
        pid = int(pid_text)
    except (FileNotFoundError, ValueError):
        return None
    if started and _started_at(pid) not in (None, started.strip()):
        return None
    return pid if _alive(pid) else None


def read_address(home: Path) -> str | None:
    """The address of a server started from ``home`` that is still running."""
    if read_pid(home) is None:
        return None
    path = home / "address"
    return path.read_text().strip() if path.exists() else None


KILLED_WAIT_S = 10.0
"""How long a stop waits for a killed process to be gone (a child is reaped meanwhile)."""


def _wait_or_kill(pid: int, running: Callable[[], bool], timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for ``pid`` to exit (while ``running`` says it runs), then
    kill it and wait up to ``KILLED_WAIT_S`` for it to go."""
    deadline, killed = time.monotonic() + timeout_s, False
    while running():
        if time.monotonic() >= deadline:
            if killed:
                return
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            deadline, killed = time.monotonic() + KILLED_WAIT_S, True
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs. A child of this process that has exited is reaped; another's
    that has exited but is not reaped yet (a zombie, which signals still reach) counts as
    gone, where ``/proc`` tells."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:  # not this process's child: its parent reaps it
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] == "Z"


def _started_at(pid: int) -> str | None:
    """When ``pid`` started, in clock ticks since boot (``/proc/PID/stat``'s 22nd field)."""
    fields = _stat(pid)
    return None if fields is None else fields[19]


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command's name (the state first), None
    where there is no such process or no ``/proc``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()
