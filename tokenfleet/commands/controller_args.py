"""The controllers' command-line settings, checked where they are given: by ``tokenfleet
controller``, and by ``tokenfleet up`` before it starts anything."""

from __future__ import annotations

import argparse
import math

from tokenfleet.commands.errors import CliError


def check_controller_args(args: argparse.Namespace) -> None:
    """CliError unless the controllers' settings in ``args`` can run (``long_cycle`` and
    ``weights_min_outcomes`` may be None: the controller's defaults)."""
    if args.weights_min_outcomes is not None and args.weights_min_outcomes < 1:
        raise CliError("--weights-min-outcomes must be at least 1")
    if args.long_cycle is not None and not 0 < args.long_cycle < math.inf:
        raise CliError("--long-cycle must be a positive number of seconds")
    if not (0 < args.period < math.inf and 3 * args.period <= args.ttl < math.inf):
        raise CliError(
            "--period must be positive and --ttl finite and at least three periods "
            "(snapshots are renewed every third of their TTL, on a pass)"
        )
