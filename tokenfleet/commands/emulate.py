"""Emulated instances and replaying workloads against an endpoint."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from tokenfleet.commands.arguments import (
    add_profile,
    api_base_url,
    check_dcs,
    consecutive_ports,
    distinct_files,
    given_options,
    nonempty_name,
    output_file,
    port,
    positive_float,
    positive_int,
    seconds,
)
from tokenfleet.commands.broker import broker
from tokenfleet.commands.errors import CliError
from tokenfleet.commands.loop import run_fast
from tokenfleet.commands.output import write_json
from tokenfleet.commands.sim import trace_help

if TYPE_CHECKING:
    from collections.abc import Sequence

    from schemas.fleet import FleetConfig, InstanceConfig
    from sim.emulator.server import FleetOptions
    from sim.replay import ReplayRecord


BASE_PORT = 8100
"""The first emulated instance's port without --fleet."""
MODEL = "emulated"
"""The model an emulated instance serves without --fleet, and replay names."""


def register(commands: argparse._SubParsersAction) -> None:
    _add_emulate(commands)
    _add_replay(commands)


def _add_emulate(commands: argparse._SubParsersAction) -> None:
    from sim.emulator.standby import WARMUP_S

    emulate = commands.add_parser(
        "emulate",
        help="emulated vLLM instances with an OpenAI-compatible API, on loopback ports",
        description="Runs N emulated instances in this process, each on 127.0.0.1 and its own "
        "port, stepping the simulator's engine in wall-clock time: vLLM's OpenAI routes "
        "(chat with tool calls, completions, responses, embeddings, tokenize) and its metrics "
        "at /metrics. With --fleet, the fleet file's instances instead (those on 127.0.0.1 "
        "or localhost, on their URLs' ports, each with its model's profile), each behind "
        "the round trip between --region and its DC's region. Stop with Ctrl-C.",
    )
    emulate.add_argument(
        "--instances", type=positive_int, help="how many (default: 1; not with --fleet)"
    )
    emulate.add_argument(
        "--base-port",
        type=port,
        help=f"the first port; the others follow (default: {BASE_PORT}; 0: any free ones, printed; "
        "not with --fleet)",
    )
    add_profile(
        emulate,
        "the calibrated model and GPUs it times its steps by (with --fleet: for the fleet "
        "file's models that name no profile)",
    )
    emulate.add_argument(
        "--model",
        type=nonempty_name,
        help=f"the model name clients use (default: {MODEL}; not with --fleet)",
    )
    emulate.add_argument(
        "--speedup",
        type=positive_float,
        default=1.0,
        help="run this many times faster than the modelled GPU (default: 1)",
    )
    emulate.add_argument(
        "--kv-events",
        action="store_true",
        help="serve the engines' KV events at /kv-events, for tokenfleet collect (vLLM "
        "publishes its own only with --kv-events-config)",
    )
    emulate.add_argument(
        "--reasoning",
        action="store_true",
        help="answer as a reasoning model served with a reasoning parser: the first half of "
        "each chat answer's tokens come as reasoning_content",
    )
    emulate.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="as vLLM's: fcfs (default), or priority, where each request's `priority` "
        "(lower first) orders the wait queue and picks whom KV pressure preempts",
    )
    emulate.add_argument(
        "--fleet",
        type=Path,
        help="start the fleet file's local instances (a multi-DC fleet on one machine), "
        "each engine with its model's profile, context_tokens and max_num_seqs",
    )
    emulate.add_argument(
        "--region",
        help="with --fleet: the region the clients (the gateway) are in, whose round trip "
        "to each DC every request pays (default: the first DC's)",
    )
    emulate.add_argument(
        "--dc", help="with --fleet: only this DC's instances (default: every DC's)"
    )
    emulate.add_argument(
        "--placement",
        action="store_true",
        help="with --fleet: follow FleetMind's placements (tf.control.placement, from "
        "tokenfleet controller; needs Kafka): an instance marked standby in the fleet file "
        "starts when a placement asks for it, after --warmup, and stops when one takes it "
        "back (without this flag, standby instances stay down)",
    )
    emulate.add_argument(
        "--warmup",
        type=seconds,
        help="with --placement: seconds a placed replica takes to load before it listens "
        f"(default: {WARMUP_S:g}, a 70B model's weights)",
    )
    emulate.set_defaults(handler=_emulate, profile=None)


def _emulate(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from sim.emulator.server import serve
    from sim.profiles import DEFAULT_PROFILE, profile

    if args.fleet is not None:
        return _emulate_fleet(args)
    if given := given_options(args, _FLEET_ONLY):
        raise CliError(f"without --fleet, {', '.join(given)} would do nothing: see --help")
    base_port = BASE_PORT if args.base_port is None else args.base_port
    ports = consecutive_ports("--base-port", base_port, args.instances or 1)
    model = args.model or MODEL

    chosen = profile(args.profile or DEFAULT_PROFILE)
    engine = replace(chosen.engine, scheduling_policy=args.scheduling_policy)

    async def run() -> None:
        emulated = serve(
            replace(chosen, engine=engine),
            model,
            ports,
            args.speedup,
            args.kv_events,
            args.reasoning,
        )
        async with emulated as instances:
            for instance in instances:
                print(f"{model} at {instance.url}/v1", flush=True)
            await asyncio.Event().wait()

    try:
        run_fast(run())
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        raise CliError(f"cannot listen on ports {ports[0]}..{ports[-1]}: {exc}") from None
    return 0


def _emulate_fleet(args: argparse.Namespace) -> int:
    from schemas.fleet import FleetFileError, load_fleet
    from sim.emulator.server import serve_fleet
    from sim.profiles import check_fleet_profiles

    if given := given_options(args, _FLEET_SETS):
        raise CliError(
            f"{', '.join(given)}: not with --fleet, whose file names the models and their "
            "instances' ports"
        )
    try:
        fleet = load_fleet(args.fleet)
        check_fleet_profiles(fleet)
    except (FleetFileError, ValueError) as exc:
        raise CliError(str(exc)) from None
    if args.profile is not None and all(m.profile for m in fleet.models):
        raise CliError("--profile: every model of the fleet file names its own profile")
    region = args.region or fleet.dcs[0].region
    regions = {dc.region for dc in fleet.dcs} | {r for link in fleet.network for r in link.regions}
    if region not in regions:
        raise CliError(f"--region {region}: the fleet file names no such region")
    check_dcs(None if args.dc is None else [args.dc], (dc.name for dc in fleet.dcs))
    if args.warmup is not None and not args.placement:
        raise CliError("--warmup needs --placement: only a placed replica warms up")
    local = fleet.local_instances(args.dc)
    if local and all(i.standby for i in local) and not args.placement:  # it served nothing
        raise CliError(
            "every instance here is on standby: --placement starts them as FleetMind "
            "places them (without it, nothing would be served)"
        )
    bootstrap = broker() if args.placement else None

    async def run() -> None:
        serving = serve_fleet(fleet, region, _fleet_options(args), dc=args.dc)
        async with serving as instances:
            for instance in instances:
                print(f"{instance.url}/v1", flush=True)
            if bootstrap is None:
                await asyncio.Event().wait()
            else:
                await _follow_placements(fleet, args, region, bootstrap)

    try:
        run_fast(run())
    except KeyboardInterrupt:
        pass
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot start the fleet's instances: {exc}") from None
    return 0


_FLEET_SETS = ("instances", "base_port", "model")
"""The options whose settings a fleet file makes: --fleet refuses them."""
_FLEET_ONLY = ("placement", "region", "dc", "warmup")
"""The options that mean something only with --fleet."""


def _fleet_options(args: argparse.Namespace) -> FleetOptions:
    from sim.emulator.server import FleetOptions
    from sim.profiles import DEFAULT_PROFILE

    return FleetOptions(
        args.speedup,
        args.kv_events,
        args.reasoning,
        args.scheduling_policy,
        args.profile or DEFAULT_PROFILE,
    )


async def _follow_placements(
    fleet: FleetConfig, args: argparse.Namespace, region: str, bootstrap: str
) -> None:
    """Start and stop the standby instances as the newest placement for their DC says."""
    from sim.emulator.server import serve_instance
    from sim.emulator.standby import WARMUP_S, StandbyReplicas
    from streams.feeds import follow
    from streams.kafka import KafkaBus
    from tokenfleet.controller_host import PLACEMENT_TOPIC

    options = _fleet_options(args)

    def serve(instance: InstanceConfig) -> contextlib.AbstractAsyncContextManager[object]:
        return serve_instance(fleet, instance, region, options)

    bus = KafkaBus(bootstrap, source=f"emulate-{args.dc or 'fleet'}")
    mine = [i for i in fleet.instances if args.dc in (None, i.dc)]
    local = {i.id for i in fleet.local_instances(args.dc)}
    warmup = WARMUP_S if args.warmup is None else args.warmup
    standby = StandbyReplicas(mine, local, serve, warmup)
    try:
        async with standby.running():
            await follow(bus, PLACEMENT_TOPIC, standby.apply, "earliest")
    finally:
        await bus.close()


def _add_replay(commands: argparse._SubParsersAction) -> None:
    replay = commands.add_parser(
        "replay",
        help="send a workload to an OpenAI-compatible endpoint at its arrival times",
        description="Streams each request of the workload to TARGET/v1/completions at its "
        "arrival time, with its class (x-tokenfleet-class) and a batch request's deadline "
        "(x-tokenfleet-deadline-s), and reports TTFT and E2E as the client saw them. With "
        "--clients, clients behave as the simulator's do: they close a stream whose first "
        "token is later than their patience (10 s for a chat, 60 s for a long document), "
        "batch clients give up at their deadline, and half of those refused or given up "
        "try once more after Retry-After.",
    )
    replay.add_argument("--trace", required=True, help=trace_help())
    replay.add_argument(
        "--target",
        type=api_base_url,
        required=True,
        help="the endpoint's base URL, with or without /v1: e.g. http://127.0.0.1:8100/v1, "
        "as emulate and gateway print it",
    )
    replay.add_argument(
        "--model",
        type=nonempty_name,
        default=MODEL,
        help=f"the model the requests name (default: {MODEL})",
    )
    replay.add_argument("--requests", type=positive_int, default=100, help="first N (default: 100)")
    replay.add_argument(
        "--speedup",
        type=positive_float,
        default=1.0,
        help="the target's speed-up (an emulator's --speedup); arrivals are compressed to "
        "match, and times are reported in the target's seconds, wall seconds x this, so the "
        "client's and the network's own milliseconds are multiplied too: keep 1 against real "
        "servers (default: 1)",
    )
    replay.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as a bearer token, as OpenAI clients do (default: $OPENAI_API_KEY; "
        "a TokenFleet gateway needs one of its tenants' keys)",
    )
    replay.add_argument(
        "--clients",
        action="store_true",
        help="clients that give up and retry, as in tokenfleet bench admission (exit 0 "
        "unless a request failed other than by a refusal or a client giving up)",
    )
    replay.add_argument("--json", type=output_file, help="write one record per request here")
    replay.set_defaults(handler=_replay)


def _replay(args: argparse.Namespace) -> int:
    """Replay the workload; on Ctrl-C, report and write the requests that had ended, and
    exit 130."""
    import sys

    import httpx

    from sim.clients import ClientModel
    from sim.registry import load_trace
    from sim.replay import replay

    distinct_files({"--json": args.json}, {"--trace": args.trace})
    finished: list[ReplayRecord] = []
    try:
        workload = load_trace(args.trace, limit=args.requests)
        headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else None
        clients = ClientModel() if args.clients else None
        records = asyncio.run(
            replay(
                workload,
                args.target,
                args.model,
                speedup=args.speedup,
                headers=headers,
                clients=clients,
                finished=finished,
                progress=True,
            )
        )
    except (ValueError, httpx.HTTPError) as exc:
        raise CliError(str(exc)) from None
    except KeyboardInterrupt:
        print(f"interrupted: {len(finished)} requests had ended", file=sys.stderr)
        _report_replay(finished, args.json)
        return 130
    _report_replay(records, args.json)
    expected = ("completed", "rejected", "cancelled") if args.clients else ("completed",)
    return 0 if all(r.outcome in expected for r in records) else 1


def _report_replay(records: Sequence[ReplayRecord], json_path: Path | None) -> None:
    """Print the latencies, outcomes and failures of ``records``; write them as JSON."""
    import sys
    from collections import Counter
    from dataclasses import asdict

    from sim.metrics import latency_stats

    ok = [r for r in records if r.outcome == "completed" and r.ttft_s is not None]
    stats = latency_stats("ttft", [r.ttft_s for r in ok]) | latency_stats(
        "e2e", [r.e2e_s for r in ok]
    )
    print(
        f"{len(ok)} of {len(records)} requests succeeded; "
        + ", ".join(f"{k} {v:.3f}" for k, v in stats.items())
    )
    outcomes = Counter(r.outcome for r in records if r.outcome not in ("completed", "failed"))
    if outcomes:
        print("; ".join(f"{outcome}: {count}" for outcome, count in sorted(outcomes.items())))
    failed = Counter(
        f"HTTP {r.status}" if r.error is None else r.error
        for r in records
        if r.outcome == "failed" or (r.status != 200 and r.outcome != "cancelled")
    )
    if failed:
        reasons = "; ".join(f"{count} with {reason}" for reason, count in failed.most_common())
        print(f"failed: {reasons}", file=sys.stderr)
    if json_path:
        write_json(json_path, [asdict(r) for r in records])
