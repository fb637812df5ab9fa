"""The stream processors and the telemetry collector, as long-running commands."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from tokenfleet.commands.arguments import check_dcs, given_options, port, positive_float
from tokenfleet.commands.broker import broker, create_topics_on
from tokenfleet.commands.controller_args import check_controller_args
from tokenfleet.commands.errors import CliError
from tokenfleet.commands.loop import until_stopped
from tokenfleet.deployment import CONTROLLER_PORT, DEFAULT_HOME
from tokenfleet.settings import Settings

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from streams.kafka import KafkaBus
    from tokenfleet.loop_status import Check


def register(commands: argparse._SubParsersAction) -> None:
    worker = commands.add_parser(
        "worker",
        help="the Faust stream processors that keep the per-DC tables",
        description="Joins request lifecycles, aggregates telemetry, KV events and outcomes "
        "into rolling per-DC capacity, KV and goodput tables, and publishes them to "
        "tf.tables.* every few seconds. Needs TOKENFLEET_KAFKA_BOOTSTRAP; workers with one "
        "TOKENFLEET_WORKER_APP_ID share the partitions. Window, slide, grace and publish "
        "interval: TOKENFLEET_WORKER_WINDOW_S, _SLIDE_S, _GRACE_S, _PUBLISH_S.",
    )
    worker.add_argument(
        "--fleet",
        type=Path,
        help="the fleet file, for its class objectives (default: the built-in objectives)",
    )
    _metrics_arguments(worker, "events taken in, dead letters by source topic, tables published")
    worker.set_defaults(handler=_worker)

    collect = commands.add_parser(
        "collect",
        help="scrape every instance's /metrics and publish tf.telemetry and tf.kv-events",
        description="Scrapes the fleet file's instances (vLLM and SGLang metric names) "
        "concurrently and publishes one tf.telemetry event per instance per round, to the "
        "broker in TOKENFLEET_KAFKA_BOOTSTRAP. Instances that serve their KV events over "
        "HTTP (/kv-events: the emulator) have them published to tf.kv-events as well. "
        "Connects to the broker before its first scrape, and exits if it cannot: /metrics "
        "(--metrics-port) answers only once it is connected.",
    )
    collect.add_argument("--fleet", type=Path, required=True, help="the fleet file")
    collect.add_argument(
        "--interval", type=positive_float, default=0.2, help="seconds between rounds (default: 0.2)"
    )
    collect.add_argument(
        "--timeout",
        type=positive_float,
        default=1.0,
        help="seconds one scrape may take (default: 1)",
    )
    _metrics_arguments(
        collect,
        "scrapes and failed scrapes by instance, the last good scrape's time, events "
        "published and failed publishes by topic",
    )
    collect.set_defaults(handler=_collect)
    _register_controller(commands)
    _register_status(commands)


def _metrics_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """``--metrics-port`` and ``--metrics-host``: where the command serves ``what`` (and
    its process's CPU and memory) as Prometheus ``/metrics``."""
    parser.add_argument(
        "--metrics-port",
        type=port,
        help=f"serve Prometheus /metrics on this port: {what}, CPU and memory "
        "(default: not served)",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address /metrics listens on (default: %(default)s)",
    )


def _register_controller(commands: argparse._SubParsersAction) -> None:
    controller = commands.add_parser(
        "controller",
        help="the controllers: goodput and capacity tables in, quotas and DC weights out",
        description="Reads tf.tables.goodput and tf.tables.capacity (from tokenfleet "
        "worker), reconciles each DC's class quotas every period (SLOMax: while chats miss "
        "their objective, fewer long documents in flight; with room to spare, more) and "
        "publishes them on tf.control.quotas, where the gateways apply them. With --fleet, "
        "FleetMind's weights too: each DC's share of its capacity the edges count on "
        "(lower while its requests miss their objectives), on tf.control.weights for every "
        "DC's gateway and every model; and its placements, where the fleet file has "
        "standby instances (see --long-cycle; tokenfleet emulate --placement applies "
        "them). Unchanged quotas and weights are published again "
        "before their TTL runs out. The operators' view (a live page, server-sent events, "
        "Prometheus metrics) is served on --port. Needs TOKENFLEET_KAFKA_BOOTSTRAP; the "
        "embedded gateway runs the same loops itself.",
    )
    controller.add_argument(
        "--period", type=float, default=5.0, help="seconds between passes (default: 5)"
    )
    controller.add_argument(
        "--fleet", type=Path, help="the fleet file: its DCs and models, for the weights loop"
    )
    controller.add_argument(
        "--ttl",
        type=float,
        default=60.0,
        help="seconds the gateways keep a snapshot without hearing a newer one; renewed "
        "every third of it (default: 60)",
    )
    controller.add_argument(
        "--port",
        type=port,
        default=CONTROLLER_PORT,
        help="serve the operators' view on 127.0.0.1:PORT: the page at /, server-sent "
        "events at /events, JSON at /api/state, Prometheus metrics at /metrics "
        "(default: %(default)s; 0: none)",
    )
    controller.add_argument(
        "--host", default="127.0.0.1", help="address the view listens on (default: 127.0.0.1)"
    )
    controller.add_argument(
        "--weights-per-region",
        action="store_true",
        help="with --fleet: judge each DC's gateway's weights on the requests of its own "
        "region alone (where at least --weights-min-outcomes of them ended in the window), "
        "not on all; off by default, as measured in docs/fleetmind.md",
    )
    controller.add_argument(
        "--weights-min-outcomes",
        type=int,
        metavar="N",
        help="with --fleet: the fewest requests (of the region, with --weights-per-region) "
        "that must have ended in a DC within the tables' window before its weight may move; "
        "lower it where each DC sees few requests a window (default: 30)",
    )
    controller.add_argument(
        "--long-cycle",
        type=float,
        default=60.0,
        help="with --fleet: seconds between passes of FleetMind's long cycle, which judges "
        "each DC's demand over that long and publishes the replicas it should run on "
        "tf.control.placement, for DCs with standby instances and models with "
        "rps_per_instance; a DC moves at most once per two cycles (default: %(default)g)",
    )
    controller.set_defaults(handler=_controller)


def _register_status(commands: argparse._SubParsersAction) -> None:
    status = commands.add_parser(
        "status",
        help="whether the control loop is closed: tables fresh, controls in force",
        description="Reads the latest tables (tf.tables.goodput, tf.tables.capacity) and "
        "controls (tf.control.quotas, tf.control.weights) from Kafka and says, per DC and "
        "per scope, how old each table and its telemetry are, which table workers (app "
        "ids) published each DC's tables in the last minute, and how long each control "
        "has left; exits 0 when the loop is closed (every table fresh and from one "
        "worker, controls in force), 1 when not, saying why, 2 when the broker cannot be "
        "read. Needs TOKENFLEET_KAFKA_BOOTSTRAP, else reads the broker of the deployment "
        "tokenfleet up recorded in --home, after saying which of its parts and services "
        "run, and which part runs but does not answer.",
    )
    status.add_argument(
        "--stale-after",
        type=positive_float,
        default=30.0,
        help="seconds after which a table is stale (default: 30, as the controllers judge)",
    )
    status.add_argument(
        "--dc",
        action="append",
        help="only this DC's tables and controls (repeat for several; default: the DCs of "
        "--fleet, else of the deployment's fleet file, else every DC the topics hold, a "
        "retired one's last tables included)",
    )
    status.add_argument(
        "--fleet",
        type=Path,
        help="only the DCs of this fleet file (the topics keep a retired DC's last tables "
        "and controls, which would read as stale for good; default: the fleet file of the "
        "deployment tokenfleet up recorded in --home, where status reads its broker)",
    )
    status.add_argument(
        "--timeout",
        type=positive_float,
        default=60.0,
        help="seconds to read the topics in before giving up with exit 2 (default: 60)",
    )
    status.add_argument(
        "--home",
        type=Path,
        default=DEFAULT_HOME,
        help="where tokenfleet up recorded its deployment, if it did: its parts must run "
        "too, and its broker is read when TOKENFLEET_KAFKA_BOOTSTRAP is unset "
        "(default: %(default)s)",
    )
    status.set_defaults(handler=_status)


def _status(args: argparse.Namespace) -> int:
    import time

    from tokenfleet.deployment import Deployment
    from tokenfleet.loop_status import (
        dead_letter_note,
        loop_checks,
        process_checks,
        publisher_checks,
        read_broker,
        verdict,
    )

    deployment = Deployment(args.home)
    named = _fleet_dcs(args.fleet, None)  # first: the file's errors need no broker
    dcs = _judged_dcs(args.dc, named, args.fleet)
    recorded = deployment.record()["settings"].get("TOKENFLEET_KAFKA_BOOTSTRAP")
    # The recorded deployment's broker even where it is down: the processes say so first.
    bootstrap = Settings().kafka_bootstrap or recorded or broker(args.home)
    processes: dict[str, int | None] = {}
    silent: dict[str, str] = {}
    recorded_fleet = None
    if recorded == bootstrap:  # else another broker's loop, which these parts are not of
        processes = deployment.pids() | deployment.service_pids()
        silent = deployment.silent_parts()
        recorded_fleet = deployment.fleet_file()  # not a DC of an earlier fleet's up
    if named is None:  # the deployment's, which the user may not have named
        dcs = _judged_dcs(args.dc, _fleet_dcs(None, recorded_fleet), recorded_fleet)
    checks = process_checks(processes, silent)
    _print_checks(checks)
    if "kafka" in processes and processes["kafka"] is None:
        raise CliError(
            f"the deployment's own Kafka broker ({bootstrap}) is not running: tokenfleet down "
            f"--home {args.home} stops what remains, then tokenfleet up --home {args.home} "
            "starts the deployment again (up refuses while any of its parts runs)"
        )
    try:
        found = asyncio.run(asyncio.wait_for(read_broker(bootstrap), args.timeout))
    except TimeoutError:
        raise CliError(f"{bootstrap} did not give the topics within {args.timeout:g} s") from None
    except Exception as exc:
        raise CliError(f"cannot read the topics from {bootstrap}: {exc}") from None
    now = time.time()
    on_the_broker = loop_checks(found.latest, now, args.stale_after, dcs)
    on_the_broker += publisher_checks(found.published, now, dcs)
    _print_checks(on_the_broker)
    if (note := dead_letter_note(found, now)) is not None:
        print(note)
    closed, why = verdict(checks + on_the_broker)
    print(f"loop {'closed' if closed else 'open'}: {why}")
    return 0 if closed else 1


def _print_checks(checks: list[Check]) -> None:
    for check in checks:
        print(f"{'ok ' if check.ok else 'NO '} {check.what:20} {check.key:16} {check.detail}")


def _worker(args: argparse.Namespace) -> int:
    from schemas import TOPICS
    from schemas.fleet import FleetFileError, load_fleet
    from streams.faust_app import build_app, run_worker, updates_topic_of
    from streams.faust_parts import WorkerApp, metrics_registry
    from streams.settings import WorkerSettings

    try:  # the file first: an error of its own is found without a broker
        objectives = load_fleet(args.fleet).all_objectives() if args.fleet else None
    except FleetFileError as exc:
        raise CliError(str(exc)) from None
    bootstrap = broker()
    settings = WorkerSettings()
    create_topics_on(bootstrap, (*TOPICS, updates_topic_of(settings)))

    def served() -> WorkerApp:
        app = build_app(bootstrap, settings, objectives, Settings().kafka_replication)
        if args.metrics_port is not None:
            _serve_metrics(metrics_registry(app), args.metrics_host, args.metrics_port)
        return app

    run_worker(served, settings.log_level)
    return 0


def _judged_dcs(
    asked: list[str] | None, fleet_dcs: list[str] | None, fleet_file: Path | None
) -> list[str] | None:
    """The DCs status judges: those ``--dc`` names (all where None), of the fleet file's
    where one is known (CliError for a DC it lacks: each read as having no table yet)."""
    if fleet_dcs is None:
        return asked
    check_dcs(asked, fleet_dcs, fleet_file)
    return [dc for dc in fleet_dcs if asked is None or dc in asked]


def _fleet_dcs(named: Path | None, recorded: Path | None) -> list[str] | None:
    """The DCs of the fleet file ``--fleet`` names (CliError where it cannot be read), else
    of the one the deployment was started with (a warning where it cannot be read any more:
    every DC is judged), else None."""
    from schemas.fleet import FleetFileError, load_fleet

    path = named or recorded
    if path is None:
        return None
    try:
        return [dc.name for dc in load_fleet(path).dcs]
    except FleetFileError as exc:
        if named is not None:
            raise CliError(str(exc)) from None
        print(f"tokenfleet: {exc}; every DC on the topics is judged", file=sys.stderr)
        return None


def _collect(args: argparse.Namespace) -> int:
    import aiohttp

    from schemas.fleet import FleetFileError, load_fleet
    from streams.collector import Collector
    from streams.kafka import KafkaBus

    try:  # the file first: an error of its own is found without a broker
        fleet = load_fleet(args.fleet)
        for instance in fleet.instances:
            instance.auth_headers(os.environ)  # refused now, not on every scrape
    except (FleetFileError, ValueError) as exc:
        raise CliError(str(exc)) from None
    bootstrap = broker()

    async def run() -> None:
        bus = KafkaBus(bootstrap, source="collector")
        async with aiohttp.ClientSession() as client:
            try:
                await _connect(bus)
                collector = Collector(fleet.instances, bus, client, args.interval, args.timeout)
                if args.metrics_port is not None:  # only now: its answering means connected
                    registry = collector.metrics.registry
                    _serve_metrics(registry, args.metrics_host, args.metrics_port)
                await until_stopped(collector.run())
            finally:
                await bus.close()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
    return 0


async def _connect(bus: KafkaBus) -> None:
    """Connect ``bus`` to its broker; CliError where it cannot be reached."""
    try:
        await bus.connect()
    except Exception as exc:
        raise CliError(f"cannot reach the Kafka broker at {bus.bootstrap}: {exc}") from None


def _serve_metrics(registry: CollectorRegistry, host: str, port: int) -> None:
    """Serve ``registry`` as Prometheus ``/metrics`` on ``host:port``, from a thread of its
    own; CliError where it cannot listen there (a taken port)."""
    from prometheus_client import start_http_server

    try:
        start_http_server(port, host, registry=registry)
    except (OSError, OverflowError) as exc:
        raise CliError(f"cannot serve /metrics on {host}:{port}: {exc}") from None


def _controller(args: argparse.Namespace) -> int:
    from control.controllers.fleetmind import WeightController, WeightParams
    from control.controllers.placement import PlacementController, PlacementParams
    from control.controllers.slomax import QuotaController, QuotaControllerParams
    from schemas.fleet import FleetFileError, load_fleet
    from streams.kafka import KafkaBus
    from tokenfleet.controller_host import PlacementHost, QuotaHost, WeightHost
    from tokenfleet.operator_page import serve_operator_view

    check_controller_args(args)
    weighing = given_options(args, ("weights_per_region", "weights_min_outcomes"))
    if args.fleet is None and weighing:
        given = ", ".join(weighing)
        raise CliError(f"{given}: without --fleet, whose DCs FleetMind weighs, it does nothing")
    try:  # the file first: an error of its own is found without a broker
        fleet = load_fleet(args.fleet) if args.fleet else None
    except FleetFileError as exc:
        raise CliError(str(exc)) from None
    bootstrap = broker()
    listening = _view_socket(args.host, args.port)  # a taken port fails before Kafka is asked
    try:
        create_topics_on(bootstrap)
    except CliError:
        if listening is not None:
            listening.close()
        raise

    async def run() -> None:
        bus = KafkaBus(bootstrap, source="controller")
        quotas = QuotaController(QuotaControllerParams(ttl_s=args.ttl))
        hosts = [QuotaHost(bus, quotas, period_s=args.period).run()]
        if fleet is not None:
            models, edges = [m.name for m in fleet.models], fleet.edge_regions()
            params = WeightParams(ttl_s=args.ttl, per_region=args.weights_per_region)
            if args.weights_min_outcomes is not None:
                params = replace(params, min_outcomes=args.weights_min_outcomes)
            weights = WeightController(params)
            hosts.append(WeightHost(bus, models, edges, weights, period_s=args.period).run())
        if fleet is not None and any(i.standby for i in fleet.instances):
            cycle = args.long_cycle
            placement = PlacementController(PlacementParams(settle_s=2 * cycle, ttl_s=10 * cycle))
            hosts.append(PlacementHost(bus, fleet, placement, period_s=cycle).run())
        if listening is not None:
            hosts.append(serve_operator_view(bus, listening, args.period))
        try:
            await until_stopped(asyncio.gather(*hosts))
        finally:
            await bus.close()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
    return 0


def _view_socket(host: str, port: int) -> socket.socket | None:
    """The operators' view's listening socket, bound now so that a taken port is an error
    before anything starts (None for port 0: no view)."""
    if port == 0:
        return None
    try:
        return socket.create_server((host, port))
    except (OSError, OverflowError) as exc:
        raise CliError(f"the operators' view cannot listen on {host}:{port}: {exc}") from None
