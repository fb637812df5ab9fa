from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

from tokenfleet.allocator import keep_freed_memory
from tokenfleet.cli import main

LIBC = ctypes.CDLL(None)
GLIBC = hasattr(LIBC, "gnu_get_libc_version")

# Run in a fresh interpreter, whose thresholds are still glibc's defaults: counts the
# chunks glibc maps from the kernel (mallinfo2's hblks) while a buffer is held. 8 MiB is
# above the default threshold and any it adapts to while Python starts, and below ours.
PROBE = """
import ctypes
from tokenfleet.allocator import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd",
        "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2

def mapped_while_held(size):
    before = libc.mallinfo2().hblks
    buffer = bytearray(size)
    return libc.mallinfo2().hblks - before

print(mapped_while_held(8 * 2**20), keep_freed_memory(), mapped_while_held(8 * 2**20),
      mapped_while_held(64 * 2**20))
"""


@pytest.mark.skipif(not hasattr(LIBC, "mallinfo2"), reason="glibc 2.33 or later only")
def test_large_buffers_come_from_the_heap_once_tuned() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True
    ).stdout.split()
    default, tuned, after, huge = out
    assert (default, tuned, after) == ("1", "True", "0")
    assert huge == "1"  # above the threshold, still mapped


def test_the_thresholds_are_set_exactly_where_the_c_library_is_glibc() -> None:
    assert keep_freed_memory() is GLIBC


def test_every_command_runs_with_the_allocator_tuned(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls = []
    monkeypatch.setattr("tokenfleet.cli.keep_freed_memory", lambda: calls.append(True))
    assert main(["schemas", "export", str(tmp_path)]) == 0
    assert calls == [True]
