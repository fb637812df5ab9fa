"""The ``tokenfleet`` command line. ``tokenfleet --help`` lists the commands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tokenfleet.commands import emulate, gateway, services, sim, streams
from tokenfleet.commands.errors import CliError
from tokenfleet.services.process import ServiceError


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (ServiceError, CliError) as exc:
        print(f"tokenfleet: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenfleet",
        description="TokenFleet: route, admit and place LLM requests across a fleet for goodput.",
    )
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    for area in (sim, emulate, gateway, streams, services):
        area.register(commands)
    return parser


if __name__ == "__main__":
    sys.exit(main())
