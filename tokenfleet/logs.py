"""How a TokenFleet process logs: a line per record with its time, level and logger, and
a message repeated within a minute written once.

Without this nothing configured logging, and Python's fallback printed bare messages:
an operator could not place an outage in time from a part's log. And during one, aiokafka
logs each failed reconnection (ten a second per client): a controller's log grew by about
21,800 lines in a 25 s broker outage. Uvicorn's and Faust's own loggers keep their
configuration."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
REPEAT_WINDOW_S = 60.0
"""A message repeated within this long of its last line is counted, not written."""
KEPT_MESSAGES = 1024
"""Past this many messages remembered, those written more than a window ago are forgotten."""


class RepeatFilter(logging.Filter):
    """Lets a record through unless one of the same logger, level and message was let
    through less than ``window_s`` ago; the next one let through says how many were held
    back. The message as written, not its template: an instance gone and another come
    back are two lines."""

    def __init__(
        self, window_s: float = REPEAT_WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.window_s = window_s
        self.clock = clock
        self._last: dict[tuple[str, int, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, record.getMessage())
        now = self.clock()
        if len(self._last) > KEPT_MESSAGES:  # messages formatted before logging are many
            self._last = {k: v for k, v in self._last.items() if now - v[0] < self.window_s}
        written_at, held = self._last.get(key, (-float("inf"), 0))
        if now - written_at < self.window_s:
            self._last[key] = (written_at, held + 1)
            return False
        self._last[key] = (now, 0)
        if held:
            record.msg = f"{record.msg} ({held} more like it in the last {now - written_at:.0f} s)"
        return True


def configure_logging(level: int = logging.WARNING) -> None:
    """Root's handler, on standard error, where nothing configured one (a test's capture,
    an embedding program's own)."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(RepeatFilter())
    root.addHandler(handler)
    root.setLevel(level)
