"""``tokenfleet recount``: the published goodput tables against the raw events."""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from tokenfleet.commands.errors import CliError

if TYPE_CHECKING:
    from tokenfleet.recount import Recount


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    recount = commands.add_parser(
        "recount",
        help="recount the goodput tables from the raw lifecycle topics and compare them "
        "with what the table worker published",
        description="Reads tf.requests, tf.completions and tf.cancellations from their "
        "start, recounts each DC's goodput table for the window of its latest published "
        "one (the worker's logic, objectives and window: --fleet and "
        "TOKENFLEET_WORKER_WINDOW_S, _SLIDE_S, _GRACE_S as the worker was given them), "
        "and prints every figure that differs. Exit 0 when every table matches, 1 when "
        "one does not. Exact once the worker has caught up: events still in flight when "
        "it published show as differences. Needs TOKENFLEET_KAFKA_BOOTSTRAP.",
    )
    recount.add_argument("--fleet", type=Path, help="the fleet file the worker was given")
    recount.add_argument(
        "--dc", action="append", help="only this DC (repeat for several; default: every DC)"
    )
    recount.add_argument("--json", type=Path, help="write the tables and differences here")
    recount.set_defaults(handler=_recount)


def _recount(args: argparse.Namespace) -> int:
    from schemas.fleet import FleetFileError, load_fleet
    from schemas.objectives import Objectives
    from streams.kafka import KafkaBus
    from streams.settings import WorkerSettings
    from tokenfleet.commands.broker import broker
    from tokenfleet.recount import recount_on

    try:
        objectives = load_fleet(args.fleet).all_objectives() if args.fleet else Objectives()
    except FleetFileError as exc:
        raise CliError(str(exc)) from None
    bootstrap = broker()

    async def run() -> Recount:
        bus = KafkaBus(bootstrap, source="recount")
        try:
            return await recount_on(bus, WorkerSettings().spec, objectives, args.dc or ())
        finally:
            await bus.close()

    try:
        result = asyncio.run(run())
    except Exception as exc:
        raise CliError(f"cannot read the topics from {bootstrap}: {exc}") from None
    _report(result)
    if args.json:
        args.json.write_text(json.dumps(_as_json(result), indent=2) + "\n")
    return 0 if result.tables and not result.differences else 1


def _report(result: Recount) -> None:
    print(f"{result.events:,} lifecycle events read ({result.undecodable} undecodable, skipped)")
    if not result.tables:
        print("no goodput table published yet (is tokenfleet worker running?)")
    for dc, (published, recounted) in sorted(result.tables.items()):
        ended = sum(r.completed for r in recounted.classes)
        print(
            f"{dc}: window {published.window_start:.0f}..{published.window_end:.0f}, "
            f"{ended} completed in the recount"
        )
    for d in result.differences:
        print(
            f"DIFFERS {d.dc} {d.row} {d.figure}: published {d.published}, recounted {d.recounted}"
        )
    count = len(result.differences)
    verdict = (
        f"{count} figure{'s differ' if count > 1 else ' differs'}"
        if count
        else ("every table matches")
    )
    print(verdict if result.tables else "nothing to compare")


def _as_json(result: Recount) -> dict[str, object]:
    return {
        "events": result.events,
        "undecodable": result.undecodable,
        "tables": {
            dc: {"published": p.model_dump(mode="json"), "recounted": r.model_dump(mode="json")}
            for dc, (p, r) in result.tables.items()
        },
        "differences": [asdict(d) for d in result.differences],
    }
