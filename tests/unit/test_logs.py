"""A process's log lines say when and how bad, and a flood of one message is one line."""

from __future__ import annotations

import logging
import subprocess
import sys

from tokenfleet.logs import RepeatFilter


def _record(msg: str, *args: object, name: str = "aiokafka") -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, args, None)


def test_a_message_repeated_within_the_window_is_written_once_then_counted() -> None:
    now = [0.0]
    repeats = RepeatFilter(window_s=60, clock=lambda: now[0])
    let_through = []
    for second in range(0, 130, 1):  # a reconnection error each second for 130 s
        now[0] = float(second)
        record = _record("Unable connect to node with id %s: %s", 1, "refused")
        if repeats.filter(record):
            let_through.append((second, record.getMessage()))
    assert [second for second, _ in let_through] == [0, 60, 120]
    assert let_through[1][1].endswith("(59 more like it in the last 60 s)")
    other = _record("Unable to update metadata from %s", "[1]")
    assert repeats.filter(other)  # another message has a window of its own
    another_node = _record("Unable connect to node with id %s: %s", 2, "refused")
    assert repeats.filter(another_node)  # so has the same template with other words


def test_a_part_s_lines_carry_their_time_level_and_logger() -> None:
    """Python's fallback printed the bare message, and nothing else configured logging."""
    script = (
        "import logging; from tokenfleet.logs import configure_logging; configure_logging(); "
        "[logging.getLogger('aiokafka').error('Unable connect to node %s', 1) for _ in range(500)]"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    lines = run.stderr.splitlines()
    assert len(lines) == 1
    assert lines[0].split()[2:] == ["ERROR", "aiokafka:", "Unable", "connect", "to", "node", "1"]
