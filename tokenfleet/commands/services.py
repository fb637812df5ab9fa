"""Schemas, topics, and the local Kafka and Redis services."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import ModuleType

from tokenfleet.commands.arguments import bootstrap, folder, output_dir
from tokenfleet.commands.broker import broker, create_topics_on
from tokenfleet.services import kafka as local_kafka
from tokenfleet.services import redis as local_redis


def register(commands: argparse._SubParsersAction) -> None:
    _add_schemas(commands)
    _add_topics(commands)
    _add_local_services(commands)


def _add_schemas(commands: argparse._SubParsersAction) -> None:
    schemas = commands.add_parser("schemas", help="message schemas")
    sub = schemas.add_subparsers(required=True, metavar="ACTION")
    export = sub.add_parser("export", help="write one JSON Schema file per message to DIR")
    export.add_argument(
        "directory",
        type=output_dir,
        metavar="DIR",
        help="the folder to write them in (made if missing)",
    )
    export.set_defaults(handler=_schemas_export)


def _schemas_export(args: argparse.Namespace) -> int:
    from schemas.export import export_json_schemas

    written = export_json_schemas(args.directory)
    print(f"wrote {len(written)} JSON Schema files to {args.directory}")
    return 0


def _add_topics(commands: argparse._SubParsersAction) -> None:
    topics = commands.add_parser("topics", help="Kafka topics of the catalog")
    sub = topics.add_subparsers(required=True, metavar="ACTION")
    create = sub.add_parser(
        "create",
        help="create the catalog's missing topics (idempotent)",
        description="Broker: --bootstrap, else $TOKENFLEET_KAFKA_BOOTSTRAP, else the local one.",
    )
    create.add_argument("--bootstrap", type=bootstrap, help="host:port of a broker")
    create.set_defaults(handler=_topics_create)
    listing = sub.add_parser("list", help="print the topic catalog")
    listing.set_defaults(handler=_topics_list)


def _topics_create(args: argparse.Namespace) -> int:
    bootstrap = args.bootstrap or broker()
    created = create_topics_on(bootstrap)
    print(
        f"{bootstrap}: created {len(created)} topics"
        + (f": {', '.join(created)}" if created else "")
    )
    return 0


def _topics_list(_: argparse.Namespace) -> int:
    from schemas import TOPICS

    print(f"{'topic':22} {'key':14} {'parts':>5}  cleanup   messages")
    for t in TOPICS:
        cleanup = "compact" if t.compacted else "delete"
        names = ", ".join(m.schema_ref() for m in t.messages)
        print(f"{t.name:22} {t.key_field:14} {t.partitions:>5}  {cleanup:8}  {names}")
    return 0


@dataclass(frozen=True)
class _LocalService:
    """A local server the CLI starts, finds and stops; one entry per service."""

    name: str
    help: str
    description: str
    module: ModuleType
    running: Callable[[Path], str | None]
    server: Callable[[Path], local_kafka.LocalKafka | local_redis.LocalRedis]
    fetch: Callable[[], Path] | None = None
    """Downloads what the service needs ahead of its first start, if anything."""


_LOCAL_SERVICES = (
    _LocalService(
        "kafka",
        "a local Kafka broker (KRaft, from Maven Central jars)",
        "A local Apache Kafka broker for development and tests: one KRaft node on free "
        "loopback ports, from Kafka's jars on Maven Central, fetched once into "
        "~/.cache/tokenfleet (needs Java 17 and Maven). `start` prints its bootstrap "
        "address, for TOKENFLEET_KAFKA_BOOTSTRAP. Not for production: one node, no "
        "replication.",
        local_kafka,
        local_kafka.running_bootstrap,
        local_kafka.LocalKafka,
        local_kafka.fetch_jars,
    ),
    _LocalService(
        "redis",
        "a local Redis server (Debian's redis-server, no persistence)",
        "A local Redis server for development and tests: Debian's redis-server on a free "
        "loopback port, nothing persisted. `start` prints its URL, for "
        "TOKENFLEET_REDIS_URL.",
        local_redis,
        local_redis.running_url,
        local_redis.LocalRedis,
    ),
)


def _add_local_services(commands: argparse._SubParsersAction) -> None:
    for service in _LOCAL_SERVICES:
        parser = commands.add_parser(
            service.name,
            help=service.help,
            description=service.description,
        )
        actions = [
            ("start", _service_start, "start it in the background; print its address"),
            ("status", _service_status, "print the running one's address (exit 1 if none)"),
            ("stop", _service_stop, "stop it"),
        ]
        if service.fetch is not None:
            actions.insert(0, ("fetch", _service_fetch, "download what it needs to start"))
        sub = parser.add_subparsers(required=True, metavar="ACTION")
        for name, handler, text in actions:
            action = sub.add_parser(name, help=text)
            action.add_argument(
                "--home",
                type=folder,
                default=service.module.DEFAULT_HOME,
                help="state folder (default: %(default)s)",
            )
            action.set_defaults(handler=partial(handler, service))


def _service_fetch(service: _LocalService, _: argparse.Namespace) -> int:
    assert service.fetch is not None
    print(service.fetch())
    return 0


def _service_start(service: _LocalService, args: argparse.Namespace) -> int:
    print(service.running(args.home) or service.server(args.home).start(detach=True))
    return 0


def _service_status(service: _LocalService, args: argparse.Namespace) -> int:
    return _print_or_fail(service.running(args.home), f"no local {service.name} runs")


def _service_stop(service: _LocalService, args: argparse.Namespace) -> int:
    service.server(args.home).stop()
    return 0


def _print_or_fail(value: str | None, message: str) -> int:
    if value is None:
        print(message, file=sys.stderr)
        return 1
    print(value)
    return 0
