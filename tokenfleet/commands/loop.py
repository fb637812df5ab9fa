"""The event loop the long-running servers run on."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_fast(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on uvloop, the loop vLLM's own server runs on (it comes with
    uvicorn[standard]); where it is missing, on asyncio's default loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
