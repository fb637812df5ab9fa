"""Argument types the commands share: each refuses a bad value while the command line is
read (usage and message, exit 2), before any work starts."""

from __future__ import annotations

import argparse
import math
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

from tokenfleet.commands.errors import CliError

T = TypeVar("T")


def add_profile(parser: argparse.ArgumentParser, what: str) -> None:
    """``--profile``: one of the calibrated profiles, ``what`` it sets."""
    from sim.profiles import DEFAULT_PROFILE, PROFILES

    parser.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        choices=sorted(PROFILES),
        help=f"{what} (default: {DEFAULT_PROFILE})",
    )


def _parsed(text: str, parse: Callable[[str], T], what: str) -> T:
    try:
        return parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None


def _whole(text: str, least: int, rule: str) -> int:
    """A whole number, ``least`` or more; a smaller one is refused as breaking ``rule``."""
    value = _parsed(text, int, "a whole number")
    if value < least:
        raise argparse.ArgumentTypeError(f"{rule}, not {value}")
    return value


def positive_int(text: str) -> int:
    """A count: a whole number, 1 or more."""
    return _whole(text, 1, "must be at least 1")


def count(text: str) -> int:
    """A number of times or steps: a whole number, 0 or more."""
    return _whole(text, 0, "must be 0 or more")


def seed(text: str) -> int:
    """A random seed: a whole number, 0 or more. numpy's generators refuse a negative one,
    and did so only once a run had started (``demo`` with a traceback)."""
    return _whole(text, 0, "a seed is 0 or more")


def bootstrap(text: str) -> str:
    """Kafka brokers, ``host[:port][,host[:port]...]`` (``tokenfleet.settings``)."""
    from tokenfleet.settings import checked_bootstrap

    try:
        return checked_bootstrap(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def nonempty_name(text: str) -> str:
    """A name: not empty (``emulate --model ""`` served its default name)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty name")
    return text


def names(text: str) -> list[str]:
    """A comma-separated list of names, each given once: an empty name or a repeated one
    is refused here (a repeated policy ran twice, an empty one was "unknown: ")."""
    given = [name.strip() for name in text.split(",")]
    if "" in given:
        raise argparse.ArgumentTypeError(f"an empty name in {text!r}")
    repeated = sorted({name for name in given if given.count(name) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"named more than once: {', '.join(repeated)}")
    return given


def seconds(text: str) -> float:
    """A duration that may be nothing: a finite number of seconds, 0 or more."""
    value = _parsed(text, float, "a number of seconds")
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(
            f"must be a finite number of seconds, 0 or more, not {text}"
        )
    return value


def positive_float(text: str) -> float:
    """A rate, a factor or a duration: a finite number above 0."""
    value = _parsed(text, float, "a number")
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, not {text}")
    return value


def port(text: str) -> int:
    """A TCP port: 0 to 65535 (0: any free one, where the command allows it)."""
    value = _parsed(text, int, "a port number")
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, not {value}")
    return value


def fixed_port(text: str) -> int:
    """A TCP port others are told in advance: 1 to 65535."""
    value = port(text)
    if value == 0:
        raise argparse.ArgumentTypeError("give a port from 1 to 65535: others must know it")
    return value


def consecutive_ports(option: str, first: int, count: int) -> list[int]:
    """``count`` ports from ``first`` on (0: any free one each); CliError, before anything
    starts, where they would run past 65535."""
    if first == 0:
        return [0] * count
    last = first + count - 1
    if last > 65535:
        raise CliError(f"{option} {first}: {count} ports from it run to {last}, past 65535")
    return list(range(first, last + 1))


def output_file(text: str) -> Path:
    """A file to write, checked before a run that may take minutes: not a folder, its
    folder made if missing, and a file can be written there (a file that is there is left
    as it is)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty name: give a file to write")
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder: give a file to write")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot make the folder of {text}: {exc}") from None
    try:
        if path.is_file():
            path.open("a").close()
        elif not path.exists():
            tempfile.TemporaryFile(dir=path.parent).close()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write {text}: {exc.strerror}") from None
    return path


def distinct_files(outputs: dict[str, Path | None], inputs: dict[str, str | Path | None]) -> None:
    """CliError, before the run, where an output option names a file another output or an
    input names (an input by name, such as a trace's, is no file): the output would
    replace the input, or one output the other, and the run still end with 0."""
    named = {
        option: Path(text)
        for option, text in inputs.items()
        if text is not None and Path(text).is_file()
    }
    named |= {option: path for option, path in outputs.items() if path is not None}
    seen: dict[Path, str] = {}
    for option, path in named.items():
        same = seen.setdefault(path.resolve(), option)
        if same != option:
            raise CliError(f"{same} and {option} both name {path}: give each its own file")


def plot_file(text: str) -> Path:
    """An image to write: an ``output_file`` whose suffix is a format matplotlib writes
    (none: ``.png`` added, as matplotlib adds it), checked before the run rather than
    when the figures are drawn."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = Path(text).suffix.lower().removeprefix(".")
    if suffix and suffix not in formats:
        known = ", ".join(f".{name}" for name in sorted(formats))
        raise argparse.ArgumentTypeError(f"{text}: matplotlib writes {known}, not .{suffix}")
    return output_file(text if suffix else f"{text}.png")


def folder(text: str) -> Path:
    """A folder, which may not exist yet: not a file, and named (``""`` was the current
    folder: ``schemas export ""`` wrote its files there)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty name: give a folder")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file: give a folder")
    return path


def output_dir(text: str) -> Path:
    """A folder to write files in: not a file; made if missing; a file can be written there."""
    path = folder(text)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot make the folder {text}: {exc}") from None
    try:
        tempfile.TemporaryFile(dir=path).close()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write in {text}: {exc.strerror}") from None
    return path


def http_url(text: str) -> str:
    """A base URL to send requests to: http or https, with a host and a valid port."""
    parts = urlsplit(text)
    try:
        parts.port  # noqa: B018 - raises on a port out of range
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"not an http(s) URL with a host: {text!r}")
    return text


def api_base_url(text: str) -> str:
    """An OpenAI-compatible endpoint's base URL, with or without the ``/v1`` that
    ``tokenfleet emulate`` and ``gateway`` print (its requests add ``/v1/...``)."""
    return http_url(text).rstrip("/").removesuffix("/v1")


def given_options(args: argparse.Namespace, options: tuple[str, ...]) -> list[str]:
    """Which of ``options`` the command line gave, as flags: each is None by default, or
    False for a switch (a --warmup of 0 is given)."""
    given = [name for name in options if vars(args)[name] is not None]
    return [f"--{name.replace('_', '-')}" for name in given if vars(args)[name] is not False]


def check_dcs(
    asked: Sequence[str] | None, fleet_dcs: Iterable[str], fleet_file: Path | None = None
) -> None:
    """CliError, before any broker is asked, for a ``--dc`` the fleet file lacks (named
    where the user did not name it)."""
    unknown = sorted(set(asked or ()) - set(fleet_dcs))
    if unknown:
        which = "" if fleet_file is None else f" ({fleet_file})"
        raise CliError(f"--dc {', '.join(unknown)}: the fleet file has no such DC{which}")
