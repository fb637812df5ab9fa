"""The error every command may raise for a problem the user can fix, and what Ctrl-C
prints."""

import signal
import sys


class CliError(Exception):
    """Printed as ``tokenfleet: message`` with exit status 2, without a traceback."""


def message_of(exc: BaseException) -> str:
    """``exc``'s text as a user should read it: ``str`` of a KeyError is the repr of its
    argument, so a registry's "unknown policy ..." came out between quotes."""
    if isinstance(exc, KeyError) and len(exc.args) == 1 and isinstance(exc.args[0], str):
        return exc.args[0]
    return str(exc)


def interrupted() -> int:
    """Say that Ctrl-C stopped the command; its exit status, as a shell gives it."""
    print("tokenfleet: interrupted", file=sys.stderr)
    return 128 + signal.SIGINT
