"""The gateway and the telemetry collector, as long-running commands."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from pathlib import Path

from tokenfleet.commands.errors import CliError

_ENVIRONMENT = (
    "Environment: TOKENFLEET_KAFKA_BOOTSTRAP (unset: an in-process bus, and the gateway "
    "scrapes its instances itself), TOKENFLEET_REDIS_URL (unset: state local to this "
    "process), TOKENFLEET_GATEWAY_* for every gateway setting (see docs/gateway.md)."
)


def register(commands: argparse._SubParsersAction) -> None:
    gateway = commands.add_parser(
        "gateway",
        help="the OpenAI-compatible gateway in front of a fleet",
        description="Serves /v1/chat/completions, /v1/completions and /v1/models for the "
        "fleet file's models, routing each request to an instance (TokenPilot by default). "
        + _ENVIRONMENT,
    )
    gateway.add_argument("--fleet", type=Path, help="the fleet file (.toml or .json)")
    gateway.add_argument("--host", default="127.0.0.1", help="address to listen on")
    gateway.add_argument("--port", type=int, default=8080, help="port (default: 8080)")
    gateway.add_argument("--policy", help="routing policy (default: tokenpilot)")
    gateway.add_argument("--dc", help="the DC this gateway serves (default: the first)")
    gateway.set_defaults(handler=_gateway)

    collect = commands.add_parser(
        "collect",
        help="scrape every instance's /metrics and publish tf.telemetry",
        description="Scrapes the fleet file's instances (vLLM and SGLang metric names) "
        "concurrently and publishes one tf.telemetry event per instance per round, to the "
        "broker in TOKENFLEET_KAFKA_BOOTSTRAP.",
    )
    collect.add_argument("--fleet", type=Path, required=True, help="the fleet file")
    collect.add_argument(
        "--interval", type=float, default=0.2, help="seconds between rounds (default: 0.2)"
    )
    collect.add_argument(
        "--timeout", type=float, default=1.0, help="seconds one scrape may take (default: 1)"
    )
    collect.set_defaults(handler=_collect)


def _gateway(args: argparse.Namespace) -> int:
    from gateway.settings import GatewaySettings
    from schemas.fleet import FleetFileError, load_fleet
    from tokenfleet.gateway_wiring import running_gateway
    from tokenfleet.settings import Settings

    overrides = {
        k: v
        for k, v in {"fleet_file": args.fleet, "policy": args.policy, "dc": args.dc}.items()
        if v is not None
    }
    settings = GatewaySettings(**overrides)
    try:
        fleet = load_fleet(settings.fleet_file)
    except FleetFileError as exc:
        raise CliError(str(exc)) from None

    async def run() -> None:
        async with running_gateway(fleet, settings, Settings(), args.host, args.port):
            print(f"gateway at http://{args.host}:{args.port}/v1", flush=True)
            await asyncio.Event().wait()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
    except (OSError, ValueError, KeyError) as exc:
        raise CliError(f"the gateway cannot start: {exc}") from None
    return 0


def _collect(args: argparse.Namespace) -> int:
    import aiohttp

    from schemas.fleet import FleetFileError, load_fleet
    from streams.collector import Collector
    from streams.kafka import KafkaBus
    from tokenfleet.settings import Settings

    bootstrap = Settings().kafka_bootstrap
    if bootstrap is None:
        raise CliError("set TOKENFLEET_KAFKA_BOOTSTRAP to the broker to publish to")
    if args.interval <= 0 or args.timeout <= 0:
        raise CliError("--interval and --timeout must be positive")
    try:
        fleet = load_fleet(args.fleet)
    except FleetFileError as exc:
        raise CliError(str(exc)) from None

    async def run() -> None:
        bus = KafkaBus(bootstrap, source="collector")
        async with aiohttp.ClientSession() as client:
            try:
                await Collector(fleet.instances, bus, client, args.interval, args.timeout).run()
            finally:
                await bus.close()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
    return 0
