"""The ``tokenfleet`` command line. ``tokenfleet --help`` lists the commands."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from types import FrameType

import prometheus_client
from pydantic import ValidationError
from pydantic_core import ErrorDetails
from pydantic_settings import SettingsError

from tokenfleet.allocator import keep_freed_memory
from tokenfleet.commands import audit, bench, deploy, emulate, gateway, services, sim, streams
from tokenfleet.commands.errors import CliError, interrupted
from tokenfleet.logs import configure_logging
from tokenfleet.services.process import ServiceError
from tokenfleet.settings import unknown_variables, variable_of


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging()
    keep_freed_memory()
    # Each counter's ``_created`` twin is one more gauge series per child in a scrape of
    # the text format, which Prometheus keeps and nobody reads; vLLM turns them off too.
    prometheus_client.disable_created_metrics()
    for warning in unknown_variables(os.environ):
        print(f"tokenfleet: warning: {warning}", file=sys.stderr)
    try:
        with _signals_as_interrupt():
            code: int = args.handler(args)
            sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
            return code
    except _Stopped as stop:
        with contextlib.suppress(OSError):  # a hung-up terminal refuses writes
            print(f"tokenfleet: {stop.said}", file=sys.stderr)
        return 128 + stop.signum
    except KeyboardInterrupt:
        return interrupted()
    except (ServiceError, CliError) as exc:
        print(f"tokenfleet: {exc}", file=sys.stderr)
        return 2
    except ValidationError as exc:
        if not exc.title.endswith("Settings"):
            raise
        print(f"tokenfleet: {_invalid_settings(exc)}", file=sys.stderr)
        return 2
    except SettingsError as exc:  # a value pydantic-settings could not decode
        print(f"tokenfleet: {exc} ({_LISTS_ARE_JSON})", file=sys.stderr)
        return 2
    except BrokenPipeError:  # its reader left (``| head``): nothing to say, nowhere to say it
        _quiet_stdout()
        return 128 + signal.SIGPIPE


def _quiet_stdout() -> None:
    """Standard output on /dev/null, so that the interpreter's flush at exit does not meet
    the broken pipe again and print a traceback after all (Python's ``signal`` docs)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


_LISTS_ARE_JSON = """a setting that holds a list is written in JSON: '["a", "b"]'"""


class _Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where Ctrl-C raises KeyboardInterrupt."""

    def __init__(self, signum: int) -> None:
        super().__init__()
        self.signum = signum
        self.said = "terminated" if signum == signal.SIGTERM else "hung up"


@contextlib.contextmanager
def _signals_as_interrupt() -> Iterator[None]:
    """SIGTERM (kill, a supervisor, a CI job's timeout) and SIGHUP (the terminal closed:
    an SSH session dropped) stop a command as Ctrl-C does: the finally blocks and exit
    stacks that stop its children (emulators, gateways, Redis, Kafka) run; SIGHUP killed
    ``up`` halfway, its parts left running. A command that drains on SIGTERM (the
    gateway) sets its own handler while it serves. A SIGHUP that is ignored (``nohup``)
    stays ignored. Only the main thread may set a handler: a command run from another (a
    test's) keeps the handlers there are."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stopped(signum: int, _frame: FrameType | None) -> None:
        raise _Stopped(signum)

    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, stopped)}
    if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, stopped)
    try:
        yield
    finally:  # None: a handler not set from Python, which cannot be set again from it
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def _invalid_settings(exc: ValidationError) -> str:
    """Settings come from the environment (``TOKENFLEET_*``): name the variable of each
    that is wrong."""
    problems = "; ".join(_problem(exc.title, error) for error in exc.errors())
    return f"invalid {exc.title} (from TOKENFLEET_* environment variables): {problems}"


def _problem(settings_class: str, error: ErrorDetails) -> str:
    if not error["loc"]:  # a rule between settings: its message names them
        return error["msg"]
    field, *within = map(str, error["loc"])
    where = ".".join([variable_of(settings_class, field), *within])
    return f"{where}={error['input']!r}: {error['msg']}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenfleet",
        description="TokenFleet: route, admit and place LLM requests across a fleet for goodput.",
    )
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    for area in (sim, bench, emulate, gateway, streams, deploy, audit, services):
        area.register(commands)
    return parser


if __name__ == "__main__":
    sys.exit(main())
