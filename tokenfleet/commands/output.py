"""The files the commands write for readers other than Python.

Each is written whole or not at all: into a temporary file beside it, which then replaces
it (``os.replace``), so a full disk or a Ctrl-C mid-write leaves the file as it was, never
half of it; but for a link (a redirected ``/dev/stdout``), a device, a file whose folder
takes no new file and one that cannot be replaced (bind-mounted), written in place. A
write that fails, after work that may have taken minutes, is a ``CliError`` naming the
file; the command has printed its figures by then."""

from __future__ import annotations

import errno
import json
import math
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tokenfleet.commands.errors import CliError

Writer = Callable[[Path], object]
"""Writes a file at the path it is given (a temporary one, with the same suffix)."""


def write_json(path: Path, document: object) -> None:
    save(path, as_json(document))


def as_json(document: object) -> Writer:
    """``document`` as strict JSON (RFC 8259), indented. A figure that does not exist (NaN:
    a quantile of a class with no completions) or is unbounded is written as null: Python
    writes them as ``NaN`` and ``Infinity`` by default, which jq, JavaScript's
    ``JSON.parse`` and most other readers refuse."""
    text = json.dumps(_finite(document), indent=2, allow_nan=False) + "\n"
    return lambda path: path.write_text(text)


def save(path: Path, write: Writer) -> None:
    """``write`` the file at ``path`` whole or not at all; CliError naming it if it fails."""
    try:
        with _replacing(path) as written:
            write(written)
    except OSError as exc:
        raise CliError(f"cannot write {path}: {exc.strerror or exc}") from None


def save_each(*outputs: tuple[Path | None, Writer]) -> None:
    """Each output whose path was given, the others written when one fails; one CliError
    naming every file that could not be."""
    failures = []
    for path, write in outputs:
        if path is None:
            continue
        try:
            save(path, write)
        except CliError as exc:
            failures.append(str(exc))
    if failures:
        raise CliError("; ".join(failures))


@contextmanager
def _replacing(path: Path) -> Iterator[Path]:
    """A temporary file beside ``path`` (same folder, so the same file system) that
    replaces it once written, with the mode the file had. Written in place instead: a
    path that is a link or not a regular file (``/dev/stdout`` redirected to a file is a
    link: replacing it put a file where the link was), a file whose folder takes no new
    file, and one that cannot be replaced (a file bind-mounted into a container)."""
    special = path.is_symlink() or (path.exists() and not path.is_file())
    temporary = None if special else _temporary_beside(path)
    if temporary is None:
        yield path
        return
    try:
        yield temporary
        if path.exists():
            shutil.copymode(path, temporary)
        try:
            os.replace(temporary, path)
        except OSError as exc:
            if exc.errno not in (errno.EBUSY, errno.EXDEV):
                raise
            shutil.copyfile(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _temporary_beside(path: Path) -> Path | None:
    """A new empty file beside ``path`` (the umask applies); None where the folder takes
    no new file but ``path`` is there to write in place."""
    temporary = path.with_name(f".{secrets.token_hex(4)}.{path.name}")
    try:
        os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except PermissionError:
        if not path.exists():
            raise
        return None
    return temporary


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value
