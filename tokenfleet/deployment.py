"""The whole control plane on one machine, one process per part: ``tokenfleet up``.

``plan`` says which processes a fleet needs, as ``tokenfleet`` command lines: one
emulator per DC (stopping it takes the DC away), the collector, the table worker, the
controllers, and a gateway per DC (the first DC's is the edge clients enter by). The same
description is what ``docker-compose.yml`` runs (a test compares the two). ``Deployment``
starts the parts as separate processes, each with its folder and log, and finds and stops
them again from another process through ``deployment.json`` in its home.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypedDict, cast
from urllib.parse import urlsplit

from gateway.settings import GatewaySettings
from schemas.fleet import FleetConfig
from tokenfleet.commands.arguments import consecutive_ports
from tokenfleet.commands.errors import CliError
from tokenfleet.commands.output import write_json
from tokenfleet.services.kafka import LocalKafka, running_bootstrap
from tokenfleet.services.process import (
    CACHE,
    STOP_TIMEOUT_S,
    ServerProcess,
    ServiceError,
    answers_http,
    python_module,
    read_pid,
    running_for,
)
from tokenfleet.services.redis import LocalRedis, running_url

DEFAULT_HOME = CACHE / "run" / "up"
NOT_A_HOME = "not a folder to keep a deployment in"
GATEWAY_PORT = 8080
"""The edge gateway's port; the other DCs' gateways take the ports after it."""
CONTROLLER_PORT = 9090
"""Where the controller serves the operators' view (``tokenfleet/operator_page.py``)."""
WORKER_PORT = 9091
"""Where the table worker serves its Prometheus metrics."""
COLLECTOR_PORT = 9094
"""Where the collector serves its Prometheus metrics (past 9092 and 9093, the Kafka
broker's and its controller's in ``docker-compose.yml``)."""
GATEWAY_DRAIN_S: int = GatewaySettings.model_fields["drain_s"].default
"""The gateways' drain where ``TOKENFLEET_GATEWAY_DRAIN_S`` is unset."""
SERVICE_SETTINGS = ("TOKENFLEET_KAFKA_BOOTSTRAP", "TOKENFLEET_REDIS_URL")
"""What every part is told of the services it shares, through its environment."""


GATEWAY_STOP_MARGIN_S = 10.0
"""What a gateway gets to exit after its drain (``TOKENFLEET_GATEWAY_DRAIN_S``) ends: it
then cancels what still runs, closes those requests' books and flushes their events to
Kafka. Killed sooner, as ``down`` did after a fixed 30 s whatever the drain, a gateway lost
the completion events of the requests it was draining."""


STARTUP_GRACE_S = 3.0
"""How long a part with no URL to ask (an emulator whose instances are all on standby)
must keep running to count as started. Without it ``up`` reported such a part started at
once, though it exited moments later (a bad ``TOKENFLEET_*`` setting, a fleet file it
cannot read); loading the CLI alone takes over a second on a busy machine."""


@dataclass(frozen=True)
class Part:
    """One process: its name, its ``tokenfleet`` arguments, the URL it serves, the URLs
    that answer once it is ready (none: it is ready once it has run ``STARTUP_GRACE_S``),
    and how long it gets to exit after SIGTERM before it is killed."""

    name: str
    args: tuple[str, ...]
    url: str | None = None
    ready_urls: tuple[str, ...] = ()
    stop_timeout_s: float = STOP_TIMEOUT_S

    @property
    def is_gateway(self) -> bool:
        return self.name.startswith("gateway-")

    @property
    def is_emulator(self) -> bool:
        return self.name.startswith("emulate-")


def _serving(
    name: str,
    args: tuple[str, ...],
    url: str,
    ready_path: str = "/health",
    stop_timeout_s: float = STOP_TIMEOUT_S,
) -> Part:
    """A part serving ``url``, ready once ``url + ready_path`` answers."""
    return Part(name, args, url, (url + ready_path,), stop_timeout_s)


def plan(
    fleet: FleetConfig,
    fleet_file: str,
    *,
    gateway_port: int = GATEWAY_PORT,
    controller_port: int = CONTROLLER_PORT,
    worker_port: int = WORKER_PORT,
    collector_port: int = COLLECTOR_PORT,
    period_s: float = 5.0,
    ttl_s: float | None = None,
    long_cycle_s: float | None = None,
    weights_min_outcomes: int | None = None,
    gateway_drain_s: int = GATEWAY_DRAIN_S,
) -> tuple[Part, ...]:
    """The parts that run ``fleet`` (read from ``fleet_file``, as every part reads it):
    ``period_s``, ``ttl_s``, ``long_cycle_s`` and ``weights_min_outcomes`` are the
    controllers' (unset: their defaults); ``gateway_drain_s`` is how long the gateways
    drain at a stop (``TOKENFLEET_GATEWAY_DRAIN_S``), which their stop timeout follows."""
    fleet_args = ("--fleet", fleet_file)
    controller: tuple[str, ...] = ("controller", *fleet_args, "--period", f"{period_s:g}")
    if ttl_s is not None:
        controller += ("--ttl", f"{ttl_s:g}")
    if long_cycle_s is not None:
        controller += ("--long-cycle", f"{long_cycle_s:g}")
    if weights_min_outcomes is not None:
        controller += ("--weights-min-outcomes", str(weights_min_outcomes))
    controller += ("--port", str(controller_port))
    return (
        *_emulators(fleet, fleet_args),
        _serving(
            "collector",
            ("collect", *fleet_args, "--metrics-port", str(collector_port)),
            f"http://127.0.0.1:{collector_port}",
            "/metrics",  # served once its Kafka bus is connected
        ),
        _serving(
            "worker",
            ("worker", *fleet_args, "--metrics-port", str(worker_port)),
            f"http://127.0.0.1:{worker_port}",
            "/metrics",  # prometheus_client's: the worker serves no /health
        ),
        _serving("controller", controller, f"http://127.0.0.1:{controller_port}"),
        *(
            _serving(
                f"gateway-{dc.name}",
                ("gateway", *fleet_args, "--dc", dc.name, "--port", str(port), "--journal"),
                f"http://127.0.0.1:{port}",
                stop_timeout_s=gateway_drain_s + GATEWAY_STOP_MARGIN_S,
            )
            for port, dc in zip(
                consecutive_ports("--gateway-port", gateway_port, len(fleet.dcs)),
                fleet.dcs,
                strict=True,
            )
        ),
    )


def _emulators(fleet: FleetConfig, fleet_args: tuple[str, ...]) -> list[Part]:
    """One emulator per DC with instances on this machine (the others are real servers),
    each behind the round trip from the edge's region; ready once every instance not on
    standby answers. A DC with standby instances follows FleetMind's placements."""
    entry_region = fleet.dcs[0].region
    parts = []
    for dc in fleet.dcs:
        local = fleet.local_instances(dc.name)
        if local:
            args = ("emulate", *fleet_args, "--dc", dc.name, "--region", entry_region)
            args += ("--kv-events", *(("--placement",) if any(i.standby for i in local) else ()))
            serving = [str(i.url).rstrip("/") for i in local if not i.standby]
            ready = tuple(url + "/health" for url in serving)
            parts.append(Part(f"emulate-{dc.name}", args, serving[0] if serving else None, ready))
    return parts


def check_ports(fleet: FleetConfig, parts: Sequence[Part]) -> None:
    """Refuse (CliError) a plan in which two servers would listen on one port, naming
    both, then one whose port another server holds now. Each was found only as its part
    started, after Kafka, Redis and the parts before it (about 25 s in), and the whole
    start rolled back; a clash named a part of the same plan as another server."""
    users: dict[int, str] = {}
    listeners = list(_listeners(fleet, parts))
    for user, (_host, port) in listeners:
        if port in users:
            raise CliError(f"port {port} is both {users[port]}'s and {user}'s: {_MOVE_ONE}")
        users[port] = user
    for user, (host, port) in listeners:
        if _held(host, port):
            raise CliError(f"{user}: another server holds {host}:{port}; stop it, or {_MOVE_ONE}")


_MOVE_ONE = (
    "move one (--gateway-port, --controller-port, --worker-port, --collector-port or the "
    "fleet file's instance URLs)"
)


def _listeners(fleet: FleetConfig, parts: Sequence[Part]) -> Iterator[tuple[str, tuple[str, int]]]:
    """Who listens where: each instance the emulators serve (those on standby too), and
    each other part that serves a URL."""
    for instance in fleet.local_instances():
        yield f"emulate-{instance.dc} (instance {instance.id})", _address(str(instance.url))
    for part in parts:
        if part.url is not None and not part.is_emulator:
            yield part.name, _address(part.url)


def _address(url: str) -> tuple[str, int]:
    """The host and port ``url`` is served on (its scheme's port where it names none)."""
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80)


def _held(host: str, port: int) -> bool:
    """Whether a server listens on ``host:port`` now, as the part's server would bind it
    (``SO_REUSEADDR``, as uvicorn and aiohttp set: a closed connection's port is free)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:  # another address family, an address not of this host: left
            return exc.errno == errno.EADDRINUSE  # to the part's own start
    return False


def _service_settings(env: Mapping[str, str]) -> dict[str, str]:
    return {key: env[key] for key in SERVICE_SETTINGS if key in env}


_SERVICE_SETTING = {"kafka": "TOKENFLEET_KAFKA_BOOTSTRAP", "redis": "TOKENFLEET_REDIS_URL"}
"""The setting that names each service ``up`` starts where it is unset."""


class Record(TypedDict):
    """What ``deployment.json`` holds."""

    parts: list[dict[str, Any]]
    settings: dict[str, str]
    own_services: list[str]


class Deployment:
    """A plan's parts run from ``home``: each in ``home/<name>`` (``server.log``, ``pid``);
    ``home/deployment.json`` holds the parts and the services' settings, for ``down`` and
    ``status`` from another process."""

    def __init__(self, home: Path = DEFAULT_HOME) -> None:
        self.home = home
        self._started: dict[str, ServerProcess] = {}
        """The parts this object started, so that stopping them also reaps them."""

    @property
    def record_path(self) -> Path:
        return self.home / "deployment.json"

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold ``home`` for one ``up`` or ``down`` at a time, or fail at once (CliError):
        two at once, or ``down`` during ``up``, left processes that no record named. The
        lock goes with this process, however it ends; the parts do not inherit it."""
        try:
            self.home.mkdir(parents=True, exist_ok=True)
            lock = (self.home / "up.lock").open("w")
        except OSError as exc:  # a file there, a folder above that cannot be made, read-only
            raise CliError(f"--home {self.home}: {NOT_A_HOME} ({exc.strerror})") from None
        with lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise CliError(
                    f"another tokenfleet up/down is running on {self.home}: wait for it to end"
                ) from None
            yield

    def start(
        self,
        parts: Sequence[Part],
        env: Mapping[str, str],
        own_services: Sequence[str] = (),
        timeout_s: float = 120.0,
        say: Callable[[Part], None] = lambda part: None,
    ) -> None:
        """Start every part in order, each with ``env`` as its environment, waiting for
        each to be ready (``say`` is told of each); on a failure, stop everything, as
        ``stop`` does, and raise. ``own_services``: the local services (``kafka``,
        ``redis``) started for this deployment, which ``stop`` stops too."""
        env = {"TOKENFLEET_WORKER_DATA_DIR": str(self.home / "worker" / "data"), **env}
        settings = _service_settings(env)
        parts_recorded = [asdict(part) for part in parts]
        self._write(
            {"parts": parts_recorded, "settings": settings, "own_services": [*own_services]}
        )
        try:
            for part in parts:
                self._launch(part, env, timeout_s)
                say(part)
        except BaseException:
            self.stop()
            raise

    def parts(self) -> list[Part]:
        """The parts of the deployment recorded in ``home`` (none if there is none); a
        record written before parts had ready URLs or stop timeouts has none of them.
        CliError for a part the record lacks the name, arguments or URL of."""
        try:
            return [
                Part(
                    p["name"],
                    tuple(p["args"]),
                    p["url"],
                    tuple(p.get("ready_urls", ())),
                    p.get("stop_timeout_s", STOP_TIMEOUT_S),
                )
                for p in self.record()["parts"]
            ]
        except (KeyError, TypeError, AttributeError) as exc:
            raise self._unreadable(f"a part without {exc}") from None

    def fleet_file(self) -> Path | None:
        """The fleet file the recorded deployment's parts were started with, if any."""
        for part in self.parts():
            if "--fleet" in part.args[:-1]:
                return Path(part.args[part.args.index("--fleet") + 1])
        return None

    def record(self) -> Record:
        """The deployment recorded in ``home``; an empty one where there is none. CliError
        where it cannot be read (cut short by a crash while an older version wrote it, or
        edited), naming it: ``up``, ``down`` and ``status`` stop there."""
        try:
            loaded: Any = json.loads(self.record_path.read_text())
        except FileNotFoundError:
            return {"parts": [], "settings": {}, "own_services": []}
        except NotADirectoryError:  # status said the deployment it recorded may still run
            raise CliError(f"--home {self.home}: {NOT_A_HOME}") from None
        except (OSError, ValueError) as exc:
            raise self._unreadable(str(exc)) from None
        if not isinstance(loaded, dict) or not Record.__required_keys__ <= loaded.keys():
            raise self._unreadable("not a deployment record")
        return cast(Record, loaded)

    def _unreadable(self, why: str) -> CliError:
        path = self.record_path
        return CliError(
            f"cannot read {path} ({why}): the deployment it recorded may still run; stop "
            f"its parts by the pid in each {self.home}/<part>/pid, then remove {path}"
        )

    def pids(self) -> dict[str, int | None]:
        """Each recorded part's process id, None for one that does not run."""
        return {part.name: read_pid(self.home / part.name) for part in self.parts()}

    def silent_parts(self, timeout_s: float = 2.0) -> dict[str, str]:
        """Each running part that does not answer at a URL ``start`` waited on before it
        counted the part ready, with the first such URL: a stopped process (SIGSTOP), or a
        server whose loop is stuck, still runs. The parts are asked at once, each URL
        within ``timeout_s``: a frozen process's connections are still accepted, and each
        question waits out its timeout."""
        running = [p for p in self.parts() if read_pid(self.home / p.name) is not None]

        def first_silent(part: Part) -> str | None:
            return next((u for u in part.ready_urls if not answers_http(u, timeout_s)), None)

        with ThreadPoolExecutor(max_workers=max(len(running), 1)) as pool:
            found = dict(zip(running, pool.map(first_silent, running), strict=True))
        return {part.name: url for part, url in found.items() if url is not None}

    def service_pids(self) -> dict[str, int | None]:
        """The process id of each service started for the deployment (``kafka``,
        ``redis``), None for one that does not run."""
        return {name: read_pid(self.home / name) for name in self.record()["own_services"]}

    def kafka_bootstrap(self) -> str | None:
        """The broker the recorded deployment's parts were told (none without a record):
        the environment's as recorded; its own only while that runs, since after a reboot
        the record stays and names a dead address, which commands would then target."""
        record = self.record()
        if "kafka" in record["own_services"]:
            return running_bootstrap(self.home / "kafka")
        return record["settings"].get("TOKENFLEET_KAFKA_BOOTSTRAP")

    def with_own_services(self, env: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
        """``env`` with a local Kafka broker and Redis server, started in ``home``, for
        the services it names none of; and which were started (for ``start``). One that
        an earlier ``up`` here started and that still runs is used again (also where ``env``
        names it); one ``env`` names another in place of is stopped (its parts are gone, as
        ``up`` checked, and the record written here would no longer name it: nothing would
        stop it)."""
        env, started = dict(env), list[str]()
        for service, pid in self.service_pids().items():
            named = env.get(_SERVICE_SETTING.get(service, ""))
            if pid is not None and named is not None and named != self._address(service):
                self._stop_service(service)  # an earlier up's, its parts gone: else orphaned
        if "TOKENFLEET_KAFKA_BOOTSTRAP" not in env:
            home = self._own("kafka", env, started)
            bootstrap = running_bootstrap(home) or LocalKafka(home).start(detach=True)
            env["TOKENFLEET_KAFKA_BOOTSTRAP"] = bootstrap
            env["TOKENFLEET_KAFKA_REPLICATION"] = "1"  # one broker keeps one copy
        if "TOKENFLEET_REDIS_URL" not in env:
            home = self._own("redis", env, started)
            env["TOKENFLEET_REDIS_URL"] = running_url(home) or LocalRedis(home).start(detach=True)
        self._write({"parts": [], "settings": _service_settings(env), "own_services": started})
        return env, started

    def _own(self, service: str, env: Mapping[str, str], started: list[str]) -> Path:
        """Record ``service`` as the deployment's own before it starts, so that ``stop``
        finds it if what follows fails (Redis missing after Kafka started, or Ctrl-C);
        its folder."""
        started.append(service)
        self._write({"parts": [], "settings": _service_settings(env), "own_services": started})
        return self.home / service

    def stop(self) -> None:
        """Stop every part, then the services started for them; forget the deployment."""
        self.stop_parts()
        own = self.record()["own_services"]
        for service in ("redis", "kafka"):
            if service in own:
                self._stop_service(service)
        self.record_path.unlink(missing_ok=True)

    def _stop_service(self, service: str) -> None:
        """Stop this home's own ``service``: ``redis``, else Kafka (callers pass only the
        two, whatever a record edited by hand may name)."""
        (LocalRedis if service == "redis" else LocalKafka)(self.home / service).stop()

    def _address(self, service: str) -> str | None:
        """Where this home's own ``service`` answers, if it runs."""
        home = self.home / service
        return running_url(home) if service == "redis" else running_bootstrap(home)

    def stop_parts(self, names: Sequence[str] | None = None) -> None:
        """Stop the parts named (default: all) in the reverse order: the gateways first,
        all at once (each drains its requests, and one after another took as many drains),
        then the others one by one."""
        chosen = [part for part in reversed(self.parts()) if names is None or part.name in names]
        self._stop_together([part for part in chosen if part.is_gateway])
        for part in chosen:
            if not part.is_gateway:
                self._stop_together([part])

    def _stop_together(self, parts: Sequence[Part]) -> None:
        """SIGTERM every part, then wait for each: one still running its stop timeout
        after its SIGTERM is killed."""
        stopping = []
        for part in parts:
            server = self._server(part)
            server.request_stop()
            stopping.append((server, time.monotonic() + part.stop_timeout_s))
        for server, deadline in stopping:
            server.wait_stopped(deadline - time.monotonic())

    def _write(self, record: Record) -> None:
        """Record what runs before starting it, so that ``stop`` finds whatever started."""
        self.home.mkdir(parents=True, exist_ok=True)
        write_json(self.record_path, record)  # whole or not at all: read by another process

    def _launch(self, part: Part, env: Mapping[str, str], timeout_s: float) -> None:
        answering = [url for url in part.ready_urls if answers_http(url)]
        if answering:
            # The new part would fail to bind while the old server answered for it.
            raise ServiceError(
                f"{part.name}: {answering[0]} already answers; another server holds the port"
            )
        server = ServerProcess(self.home / part.name, part.name)
        self._started[part.name] = server
        server.launch(
            [*python_module("tokenfleet"), *part.args],
            ready=_readiness(part),
            timeout_s=timeout_s,
            detach=True,
            env=env,
        )

    def _server(self, part: Part) -> ServerProcess:
        """The part's process: the one started here, else the one its folder names."""
        return self._started.pop(part.name, None) or ServerProcess(self.home / part.name, part.name)


def _readiness(part: Part) -> Callable[[], bool]:
    """Whether ``part``, just launched, is ready: every URL of its own answers; with none,
    it has kept running for ``STARTUP_GRACE_S`` (``launch`` notices an exit first)."""
    if part.ready_urls:
        return lambda: all(answers_http(url) for url in part.ready_urls)
    return running_for(STARTUP_GRACE_S)
