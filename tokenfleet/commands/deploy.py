"""``tokenfleet up`` and ``down``: the whole control plane on this machine."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from tokenfleet.commands.arguments import fixed_port
from tokenfleet.commands.broker import check_redis
from tokenfleet.commands.controller_args import check_controller_args
from tokenfleet.commands.errors import CliError
from tokenfleet.deployment import (
    COLLECTOR_PORT,
    CONTROLLER_PORT,
    DEFAULT_HOME,
    GATEWAY_PORT,
    GATEWAY_STOP_MARGIN_S,
    WORKER_PORT,
    Deployment,
    check_ports,
    plan,
)
from tokenfleet.services.process import STOP_TIMEOUT_S
from tokenfleet.settings import Settings

LOCAL_FLEET = Path("examples/fleet-local.toml")


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    up = commands.add_parser(
        "up",
        help="start the whole control plane here: emulated DCs, collector, table worker, "
        "controllers, gateways, on real Kafka and Redis",
        description="Starts one process per part of the fleet file's deployment, in the "
        "background, each logging to HOME/<part>/server.log: an emulator per DC for its "
        "instances on this machine (an instance URL on 127.0.0.1 or localhost is emulated; "
        "the parts are put in front of the other URLs as real servers, so a real server on "
        "this machine needs the parts started one by one, as the README shows), the "
        "collector, the table worker, the controllers, and a gateway per DC (the first "
        "DC's is the edge, on --gateway-port; the others on the ports after it). Kafka and "
        "Redis: TOKENFLEET_KAFKA_BOOTSTRAP and TOKENFLEET_REDIS_URL, else a local broker "
        "and server started in HOME. Every other TOKENFLEET_* setting in the environment "
        "reaches the parts. docker-compose.yml runs the same parts. "
        "Then: tokenfleet status, tokenfleet down.",
    )
    up.add_argument(
        "--fleet", type=Path, default=LOCAL_FLEET, help="the fleet file (default: %(default)s)"
    )
    _home_argument(up)
    up.add_argument(
        "--gateway-port",
        type=fixed_port,
        default=GATEWAY_PORT,
        help="the edge gateway's port (default: %(default)s)",
    )
    up.add_argument(
        "--controller-port",
        type=fixed_port,
        default=CONTROLLER_PORT,
        help="the operators' view, served by the controller (default: %(default)s)",
    )
    up.add_argument(
        "--worker-port",
        type=fixed_port,
        default=WORKER_PORT,
        help="the table worker's Prometheus /metrics (default: %(default)s)",
    )
    up.add_argument(
        "--collector-port",
        type=fixed_port,
        default=COLLECTOR_PORT,
        help="the collector's Prometheus /metrics (default: %(default)s)",
    )
    up.add_argument(
        "--period", type=float, default=5.0, help="the controllers' period (default: 5 s)"
    )
    up.add_argument("--ttl", type=float, default=60.0, help="the controls' TTL (default: 60 s)")
    up.add_argument(
        "--long-cycle",
        type=float,
        help="FleetMind's long cycle, in seconds (default: the controller's, 60)",
    )
    up.add_argument(
        "--weights-min-outcomes",
        type=int,
        metavar="N",
        help="the fewest requests ended in a DC within the tables' window for FleetMind to "
        "move its weight (default: the controller's, 30); lower it for light traffic",
    )
    up.set_defaults(handler=_up)
    down = commands.add_parser(
        "down",
        help="stop what tokenfleet up started",
        description="Stops every part of the deployment in HOME, the gateways first (all at "
        "once; each gets its drain, TOKENFLEET_GATEWAY_DRAIN_S as up ran with it, plus "
        f"{GATEWAY_STOP_MARGIN_S:g} s before it is killed; the others {STOP_TIMEOUT_S:g} s), "
        "then the Kafka broker and Redis server it started (their logs stay in HOME).",
    )
    _home_argument(down)
    down.set_defaults(handler=_down)


def _home_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--home",
        type=Path,
        default=DEFAULT_HOME,
        help="the deployment's folder: its record and each part's log (default: %(default)s)",
    )


def _up(args: argparse.Namespace) -> int:
    check_controller_args(args)
    deployment = Deployment(args.home)
    with deployment.exclusive():
        return _deploy(deployment, args)


def _deploy(deployment: Deployment, args: argparse.Namespace) -> int:
    """``up`` once this process holds the deployment's folder."""
    from gateway.redis_state import without_password
    from gateway.settings import GatewaySettings
    from schemas import TOPICS
    from schemas.fleet import FleetFileError, load_fleet
    from sim.profiles import check_fleet_profiles
    from streams.kafka import create_topics

    if any(pid is not None for pid in deployment.pids().values()):
        raise CliError(f"a deployment runs from {args.home}: tokenfleet down --home {args.home}")
    try:
        fleet = load_fleet(args.fleet)
        check_fleet_profiles(fleet)  # else an emulator or a gateway exits at its start
    except (FleetFileError, ValueError) as exc:
        raise CliError(str(exc)) from None
    parts = plan(
        fleet,
        str(args.fleet.resolve()),  # status, from any folder, reads it back
        gateway_port=args.gateway_port,
        controller_port=args.controller_port,
        worker_port=args.worker_port,
        collector_port=args.collector_port,
        period_s=args.period,
        ttl_s=args.ttl,
        long_cycle_s=args.long_cycle,
        weights_min_outcomes=args.weights_min_outcomes,
        gateway_drain_s=GatewaySettings().drain_s,  # the environment the gateways get
    )
    check_ports(fleet, parts)
    copies = Settings().kafka_replication  # checked before any service starts
    try:
        if "TOKENFLEET_REDIS_URL" in os.environ:  # before a broker of its own starts
            check_redis(os.environ["TOKENFLEET_REDIS_URL"])
        env, own = deployment.with_own_services(os.environ)
        redis = without_password(env["TOKENFLEET_REDIS_URL"])
        print(f"Kafka at {env['TOKENFLEET_KAFKA_BOOTSTRAP']}, Redis at {redis}")
        replication = 1 if "kafka" in own else copies  # its own broker is one
        asyncio.run(create_topics(env["TOKENFLEET_KAFKA_BOOTSTRAP"], TOPICS, replication))
        deployment.start(parts, env, own, say=lambda p: print(f"  started {p.name}", flush=True))
    except BaseException as exc:
        deployment.stop()  # the services started for it too
        if isinstance(exc, Exception) and not isinstance(exc, CliError):
            raise CliError(f"the deployment did not start: {exc}") from None
        raise
    edge = next(part.url for part in parts if part.is_gateway)
    print(
        f"The edge gateway: {edge}/v1 (an API key of the fleet file's tenants); the "
        f"operators' page: http://127.0.0.1:{args.controller_port}/; the table worker's "
        f"metrics: http://127.0.0.1:{args.worker_port}/metrics, the collector's: "
        f"http://127.0.0.1:{args.collector_port}/metrics.\n"
        f"Logs: {args.home}/<part>/server.log. Next: tokenfleet status --home {args.home}; "
        f"tokenfleet down --home {args.home}."
    )
    return 0


def _down(args: argparse.Namespace) -> int:
    deployment = Deployment(args.home)
    if args.home.exists():  # else no deployment: the lock would make the folder
        with deployment.exclusive():
            if deployment.record_path.exists():
                deployment.stop()
                print(f"stopped the deployment in {args.home}")
                return 0
    print(f"no deployment in {args.home}")
    return 0
