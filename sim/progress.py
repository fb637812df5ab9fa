"""Progress bars for long work, shown while stderr is a terminal."""

from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

from tqdm import tqdm  # type: ignore[import-untyped]

T = TypeVar("T")


def progress_bar(*args: Any, disable: bool = False, **options: Any) -> Any:
    """``tqdm``'s bar, left out where stderr is no terminal (a log file, CI): there its
    carriage returns run every update into one garbled line (``disable=None`` is tqdm's
    own test for a terminal); and where ``disable``."""
    return tqdm(*args, disable=True if disable else None, **options)


def with_progress(items: Sequence[T], show: bool, label: str, unit: str = "req") -> Iterator[T]:
    """``items`` one by one, with a bar labelled ``label`` while ``show`` (and stderr is a
    terminal), gone once they are all taken."""
    bar: Iterator[T] = iter(
        progress_bar(items, desc=label, unit=unit, leave=False, disable=not show)
    )
    return bar
