"""Keep freed heap memory in the process for reuse, where the C library is glibc.

A Python dict that grows, or that has taken and dropped many keys, is rebuilt into a new
table. At a few thousand keys that table is over 128 KiB. By default glibc maps an
allocation that large fresh from the kernel, and unmaps it when it is freed; it also hands
free memory at the top of its heap back to the kernel. The next such table then faults in
zeroed pages, one by one.

The prefix index keeps an LRU dict per instance, and each is rebuilt this way every few
dozen prompts routed there. On this project's machine those page faults added about a
sixth to the slowest 1 % of routing decisions (``tokenfleet bench decision``,
``docs/routing.md``, "Decision time"). With fixed thresholds, glibc serves such tables
from its heap, and keeps up to ``TRIM_THRESHOLD`` bytes of free heap for the next one.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20
"""Allocations below this come from the heap: glibc's largest threshold on 64-bit."""
TRIM_THRESHOLD = 128 * 2**20
"""Free heap kept before any is returned to the kernel."""


def keep_freed_memory() -> bool:
    """Set glibc's thresholds for this process; False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols, the C library's among them
    except (OSError, TypeError):  # Windows has no such handle
        return False
    if not hasattr(libc, "gnu_get_libc_version"):
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
