"""Progress bars for long work, shown while stderr is a terminal."""

from typing import Any

from tqdm import tqdm  # type: ignore[import-untyped]


def progress_bar(*args: Any, **options: Any) -> Any:
    """``tqdm``'s bar, left out where stderr is no terminal (a log file, CI): there its
    carriage returns run every update into one garbled line (``disable=None`` is tqdm's
    own test for a terminal)."""
    return tqdm(*args, disable=None, **options)
