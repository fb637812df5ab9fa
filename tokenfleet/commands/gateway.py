"""The gateway, as a long-running command."""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenfleet.commands.arguments import port
from tokenfleet.commands.errors import CliError, message_of
from tokenfleet.commands.loop import (
    allow_open_files,
    run_fast,
    tune_gc_for_serving,
    until_stopped,
)

_ENVIRONMENT = (
    "Environment: TOKENFLEET_KAFKA_BOOTSTRAP (unset: an in-process bus, and the gateway "
    "scrapes its instances itself), TOKENFLEET_REDIS_URL (unset: state local to this "
    "process), TOKENFLEET_GATEWAY_* for every gateway setting (see docs/gateway.md)."
)


def register(commands: argparse._SubParsersAction) -> None:
    gateway = commands.add_parser(
        "gateway",
        help="the OpenAI-compatible gateway in front of a fleet",
        description="Serves the OpenAI API (/v1/chat/completions, /v1/completions, "
        "/v1/responses, /v1/embeddings, /v1/models) and vLLM's /tokenize and /detokenize "
        "for the fleet file's models: admits each request by class (SLOMax by default: now, held "
        "in its class pool, or refused with 429 / 503) and routes it to an instance "
        "(TokenPilot by default). SIGTERM or Ctrl-C stops it, answering held requests "
        "first. " + _ENVIRONMENT,
    )
    gateway.add_argument(
        "--fleet",
        type=Path,
        help="the fleet file, .toml or .json (default: TOKENFLEET_GATEWAY_FLEET_FILE, else "
        "fleet.toml in the current folder); it needs a tenant with the clients' keys, and "
        "under the default policies a calibrated profile per model",
    )
    gateway.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)"
    )
    gateway.add_argument(
        "--port", type=port, default=8080, help="port (default: 8080; 0: any free one, printed)"
    )
    gateway.add_argument(
        "--policy",
        help="routing policy (default: the fleet file's [routing] policy, else tokenpilot)",
    )
    gateway.add_argument(
        "--admission",
        help="admission policy (default: slomax; fcfs admits everything; the others are "
        "the baselines of tokenfleet bench admission)",
    )
    gateway.add_argument("--dc", help="the DC this gateway serves (default: the first)")
    gateway.add_argument(
        "--dc-policy",
        help="how the gateway picks the DC of each request (default: fleetmind; "
        "local_only, envoy_priority_failover, gcp_waterfall, skyserve_least_load and "
        "llmd_multicluster are the baselines of docs/fleetmind.md)",
    )
    gateway.add_argument(
        "--journal",
        action="store_const",
        const=True,
        help="publish the decision journal on tf.audit.journal (Kafka), for tokenfleet "
        "audit (TOKENFLEET_GATEWAY_JOURNAL); without Kafka, set "
        "TOKENFLEET_GATEWAY_JOURNAL_FILE instead of this flag",
    )
    gateway.set_defaults(handler=_gateway)


def _gateway(args: argparse.Namespace) -> int:
    from gateway.settings import GatewaySettings
    from schemas.fleet import FleetFileError, load_fleet
    from tokenfleet.gateway_wiring import running_gateway
    from tokenfleet.settings import Settings

    overrides = {
        k: v
        for k, v in {
            "fleet_file": args.fleet,
            "policy": args.policy,
            "admission": args.admission,
            "dc": args.dc,
            "dc_policy": args.dc_policy,
            "journal": args.journal,
        }.items()
        if v is not None
    }
    settings = GatewaySettings(**overrides)
    services = Settings()  # here, a setting's error is named as one (cli's message)
    try:
        fleet = load_fleet(settings.fleet_file)
    except FleetFileError as exc:
        raise CliError(str(exc)) from None
    if not fleet.tenants:
        raise CliError(
            f"{settings.fleet_file} names no tenant: the gateway would answer every request "
            "401; give it [[tenants]] with the clients' api_keys (examples/fleet.toml)"
        )

    async def run() -> None:
        allow_open_files()
        async with running_gateway(fleet, settings, services, args.host, args.port) as app:
            print(f"gateway at http://{app.state.address}/v1", flush=True)
            tune_gc_for_serving()
            await until_stopped()

    try:
        run_fast(run())
    except KeyboardInterrupt:
        pass
    except (OSError, ValueError, KeyError) as exc:
        raise CliError(f"the gateway cannot start: {message_of(exc)}") from None
    return 0
