"""``tokenfleet recount``: the published goodput tables against the raw events."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas import Envelope
from schemas.topics import JOURNAL_TOPIC, TOPICS
from tokenfleet.commands.arguments import check_dcs, distinct_files, output_file
from tokenfleet.commands.deploy import LOCAL_FLEET
from tokenfleet.commands.errors import CliError, message_of
from tokenfleet.commands.output import write_json

if TYPE_CHECKING:
    from control.journal import Difference
    from tokenfleet.recount import Recount
    from tokenfleet.whatif import Stack


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
    recount.add_argument("--json", type=output_file, help="write the tables and differences here")
    recount.set_defaults(handler=_recount)
    _register_whatif(commands)
    _register_audit(commands)


def _register_audit(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    audit = commands.add_parser(
        "audit",
        help="make every journaled decision again from its recorded inputs and report "
        "those that come out different",
        description="Reads the gateways' decision journals (gateways started with "
        "TOKENFLEET_GATEWAY_JOURNAL=true publish them on tf.audit.journal; "
        "TOKENFLEET_GATEWAY_JOURNAL_FILE writes them to a file), rebuilds each pool's "
        "admission and router from the recipe its journal begins with, replays every call "
        "in order (arrivals with the snapshots they were decided on, release passes, "
        "first tokens, ends and what the router observed, KV events, quotas) and compares "
        "each decision: verdict, reason, instance, every candidate's score. DC choices "
        "are made again from their recorded view of the DCs. Exit 0 when every decision "
        "is reproduced, 1 when one is not, a journal has a gap, or there was no decision "
        "to compare.",
    )
    audit.add_argument(
        "--from",
        dest="sources",
        action="append",
        metavar="TOPIC|FILE",
        help="a journal file, or a topic (needs TOKENFLEET_KAFKA_BOOTSTRAP); repeat for "
        f"several (default: {JOURNAL_TOPIC})",
    )
    audit.add_argument("--json", type=output_file, help="write each journal's result here")
    audit.set_defaults(handler=_audit)


def _audit(args: argparse.Namespace) -> int:
    from tokenfleet.audit import audit_journal, journals_in

    sources = args.sources or [JOURNAL_TOPIC]
    distinct_files({"--json": args.json}, {f"--from {source}": source for source in sources})
    envelopes, undecodable = _journal_envelopes(sources)
    journals, malformed = journals_in(envelopes)
    audits = [audit_journal(name, records) for name, records in journals.items()]
    print(
        f"{len(envelopes):,} records read ({undecodable} undecodable, {malformed} without "
        "a number or call: skipped)"
    )
    for audit in sorted(audits, key=lambda a: a.journal):
        verdict = audit.problem or (
            "every decision reproduced"
            if audit.reproduced
            else f"{len(audit.differences)} decisions differ"
        )
        print(
            f"{audit.journal}: {audit.records:,} records, {audit.decisions:,} decisions, {verdict}"
        )
        for d in audit.differences[:5]:
            _print_difference(d)
    compared = any(a.decisions for a in audits)
    if not audits:
        print("no journal found (are the gateways started with TOKENFLEET_GATEWAY_JOURNAL=true?)")
    elif not compared:
        print("no decision to compare: the journals hold none")
    if args.json:
        document = [asdict(a) | {"reproduced": a.reproduced} for a in audits]
        write_json(args.json, document)
    return 0 if compared and all(a.reproduced for a in audits) and not malformed else 1


def _print_difference(difference: Difference, fields: int = 8) -> None:
    """A decision that came out different: the fields that differ, each with both values
    (up to ``fields`` of them; ``--json`` has the whole results)."""
    from tokenfleet.audit import fields_that_differ

    print(f"  DIFFERS record {difference.seq} ({difference.call}):")
    recorded, replayed = difference.recorded, difference.replayed
    differing = list(fields_that_differ(recorded, replayed)) or [("", recorded, replayed)]
    for at, mine, theirs in differing[:fields]:
        print(f"    {at or 'the result'}: recorded {_brief(mine)}, replayed {_brief(theirs)}")
    if len(differing) > fields:
        print(f"    and {len(differing) - fields} more fields")


def _brief(result: object, limit: int = 120) -> str:
    from tokenfleet.audit import ABSENT

    text = repr(ABSENT) if result is ABSENT else json.dumps(result)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _journal_envelopes(sources: list[str]) -> tuple[list[Envelope], int]:
    """The envelopes of every source: files read from disk, topics from the broker."""
    from tokenfleet.audit import read_file

    envelopes: list[Envelope] = []
    undecodable = 0
    topics = [s for s in sources if not Path(s).exists()]
    for source in sources:
        if source not in topics:
            try:
                read, skipped = read_file(Path(source))
            except OSError as exc:
                raise CliError(f"cannot read {source}: {exc}") from None
            envelopes += read
            undecodable += skipped
    unknown = [t for t in topics if t not in {topic.name for topic in TOPICS}]
    if unknown:
        raise CliError(f"no such file or topic: {', '.join(unknown)}")
    if topics:
        read, skipped = _read_topics(topics)
        envelopes += read
        undecodable += skipped
    return envelopes, undecodable


def _read_topics(topics: list[str]) -> tuple[list[Envelope], int]:
    from streams.kafka import KafkaBus
    from tokenfleet.commands.broker import broker

    bootstrap = broker()

    async def run() -> tuple[list[Envelope], int]:
        bus = KafkaBus(bootstrap, source="audit")
        envelopes: list[Envelope] = []
        undecodable = 0
        try:
            for name in topics:
                read, skipped = await bus.read_all(name)
                envelopes += read
                undecodable += skipped
        finally:
            await bus.close()
        return envelopes, undecodable

    try:
        return asyncio.run(run())
    except Exception as exc:
        raise CliError(f"cannot read {', '.join(topics)} from {bootstrap}: {exc}") from None


def _register_whatif(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from control.admission.registry import ADMISSIONS
    from control.fleet.registry import DC_POLICIES
    from control.routing import ROUTERS

    whatif = commands.add_parser(
        "whatif",
        help="re-simulate the recorded arrivals under another policy stack",
        description="Reads the arrivals on tf.requests (each in the DC it was routed to, "
        "with the output length its completion on tf.completions recorded), simulates "
        "each DC's arrivals on its instances from the fleet file under the stack the "
        "gateways run (the fleet file's routing policy and SLOMax) and under the one asked "
        "for, and prints both with what the clients got. Both sides are simulated alike: "
        "the difference is the policies'. Needs TOKENFLEET_KAFKA_BOOTSTRAP (or tokenfleet up).",
    )
    whatif.add_argument(
        "--fleet", type=Path, default=LOCAL_FLEET, help="the fleet file (default: %(default)s)"
    )
    whatif.add_argument(
        "--policy",
        choices=sorted(ROUTERS),
        help="the routing policy to try (default: the fleet's)",
    )
    whatif.add_argument(
        "--admission",
        default="slomax",
        choices=sorted(ADMISSIONS),
        help="the admission policy to try (default: slomax)",
    )
    whatif.add_argument(
        "--dc", action="append", help="only this DC (repeat for several; default: every DC)"
    )
    whatif.add_argument(
        "--dc-policy",
        choices=sorted(DC_POLICIES),
        help="re-make the choice of DC too: simulate the whole fleet on every arrival "
        "(each entering at its gateway's region, refused ones included) under this DC "
        "policy and under the gateways' (TOKENFLEET_GATEWAY_DC_POLICY, default fleetmind), "
        "each DC behind SLOMax and the fleet's routing policy",
    )
    whatif.add_argument("--json", type=output_file, help="write the figures here")
    whatif.set_defaults(handler=_whatif)


def _recount(args: argparse.Namespace) -> int:
    from schemas.fleet import FleetFileError, load_fleet
    from schemas.objectives import Objectives
    from streams.kafka import KafkaBus
    from streams.settings import WorkerSettings
    from tokenfleet.commands.broker import broker
    from tokenfleet.recount import recount_on

    distinct_files({"--json": args.json}, {"--fleet": args.fleet})

    try:
        fleet = load_fleet(args.fleet) if args.fleet else None
    except FleetFileError as exc:
        raise CliError(str(exc)) from None
    if fleet is not None:
        check_dcs(args.dc, (dc.name for dc in fleet.dcs))
    objectives = fleet.all_objectives() if fleet is not None else Objectives()
    spec = WorkerSettings().spec  # here, a setting's error is named as one, not the broker's
    bootstrap = broker()

    async def run() -> Recount:
        bus = KafkaBus(bootstrap, source="recount")
        try:
            return await recount_on(bus, spec, objectives, args.dc or ())
        finally:
            await bus.close()

    try:
        result = asyncio.run(run())
    except Exception as exc:
        raise CliError(f"cannot read the topics from {bootstrap}: {exc}") from None
    missing = [dc for dc in args.dc or () if dc not in result.tables]
    _report(result, missing)
    if args.json:
        write_json(args.json, _as_json(result))
    return 0 if result.tables and not result.differences and not missing else 1


def _report(result: Recount, missing: Sequence[str]) -> None:
    """``missing``: the DCs asked for that have no table."""
    print(f"{result.events:,} lifecycle events read ({result.undecodable} undecodable, skipped)")
    if missing:  # the worker may well run: asked of other DCs, it said it did not
        print(f"no goodput table published for {', '.join(missing)}")
    elif not result.tables:
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


def _whatif(args: argparse.Namespace) -> int:
    from schemas.fleet import FleetFileError, load_fleet
    from streams.kafka import KafkaBus
    from tokenfleet.commands.broker import broker
    from tokenfleet.whatif import WHATIF_TOPICS, Stack, recorded, whatif, whatif_fleet

    distinct_files({"--json": args.json}, {"--fleet": args.fleet})

    try:
        fleet = load_fleet(args.fleet)
    except FleetFileError as exc:
        raise CliError(str(exc)) from None
    check_dcs(args.dc, (dc.name for dc in fleet.dcs))
    running = Stack(fleet.routing.policy, "slomax")
    asked = Stack(args.policy or running.policy, args.admission)
    dc_policies = _dc_policies(args.dc_policy)
    if dc_policies and (args.policy or args.admission != "slomax" or args.dc):
        raise CliError(
            "--dc-policy simulates the whole fleet under the gateways' stack: "
            "--policy, --admission and --dc do not apply to it"
        )
    if asked == running and not dc_policies:
        raise CliError(f"--policy or --admission must name a stack other than {running.name}")
    bootstrap = broker()

    async def read() -> list[Envelope]:
        bus = KafkaBus(bootstrap, source="whatif")
        try:
            return [e for topic in WHATIF_TOPICS for e in (await bus.read_all(topic))[0]]
        finally:
            await bus.close()

    try:
        record = recorded(asyncio.run(read()))
    except Exception as exc:
        raise CliError(f"cannot read the topics from {bootstrap}: {exc}") from None
    try:
        if dc_policies and not record.arrivals:
            print("no recorded arrivals on tf.requests")
            return 1
        if dc_policies:
            figures = whatif_fleet(record, fleet, dc_policies)
            _print_fleet_whatif(figures, len(record.arrivals))
        else:
            figures = whatif(record, fleet, [running, asked], args.dc or ())
            _print_whatif(figures, running, asked, record.unrouted)
    except (KeyError, ValueError) as exc:
        raise CliError(f"cannot simulate: {message_of(exc)}") from None
    if args.json:
        write_json(args.json, figures)
    return 0 if figures else 1


def _dc_policies(asked: str | None) -> list[str]:
    """The gateways' DC policy and ``asked`` (none: no fleet what-if)."""
    from gateway.settings import GatewaySettings

    if asked is None:
        return []
    running = GatewaySettings().dc_policy
    if asked == running:
        raise CliError(f"--dc-policy must name a policy other than the gateways' ({running})")
    return [running, asked]


def _print_fleet_whatif(figures: dict[str, Any], arrivals: int) -> None:
    print(f"{arrivals} arrivals, the whole fleet simulated under each DC policy")
    for name, f in figures.items():
        where = ", ".join(f"{dc} {n}" for dc, n in f["per_dc"].items())
        print(
            f"  {name:22} goodput {f['goodput_tok_s']:9.1f} tok/s, "
            f"{100 * f['compliance']:5.1f} % in time, {100 * f['cross_dc_share']:4.1f} % "
            f"outside their home DC, {f['refused']} refused ({where})"
        )
    (running, mine), (asked, theirs) = figures.items()
    change = theirs["goodput_tok_s"] / mine["goodput_tok_s"] if mine["goodput_tok_s"] else 0
    print(f"  {asked}: {change:.2f} x the goodput of {running}")


def _print_whatif(figures: dict[str, Any], running: Stack, asked: Stack, unrouted: int) -> None:
    if not figures:
        print("no recorded arrivals in a DC of the fleet file")
    print(f"{unrouted} arrivals no DC ran are left out")
    for dc, by_stack in figures.items():
        measured = by_stack["measured"]
        print(
            f"{dc} ({by_stack['instances']} instances, {measured['requests']} arrivals): "
            f"clients got {measured['completed']} completions, "
            f"TTFT P50/P95 {measured['ttft_p50_s']:.3f}/{measured['ttft_p95_s']:.3f} s"
        )
        for stack in (running, asked):
            f = by_stack[stack.name]
            print(
                f"  {stack.name:32} goodput {f['goodput_tok_s']:9.1f} tok/s, "
                f"{100 * f['compliance']:5.1f} % in time, "
                f"TTFT P50/P95 {f['ttft_p50_s']:.3f}/{f['ttft_p95_s']:.3f} s"
            )
        mine, theirs = by_stack[running.name], by_stack[asked.name]
        change = theirs["goodput_tok_s"] / mine["goodput_tok_s"] if mine["goodput_tok_s"] else 0
        print(f"  {asked.name}: {change:.2f} x the goodput of {running.name}")
