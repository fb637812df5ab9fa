"""A request waiting for the gateway's decision lock is given up when its client leaves."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.types import Message

from gateway.exchange import _lock_unless_gone


def leaving() -> tuple[Request, asyncio.Event]:
    """A request whose client leaves once the event is set."""
    left = asyncio.Event()

    async def receive() -> Message:
        await left.wait()
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "headers": []}, receive), left


async def waiting_for_a_held_lock() -> tuple[asyncio.Lock, asyncio.Task[bool], asyncio.Event]:
    """A lock another request's decision holds, and a request waiting for it whose client
    leaves once the event is set."""
    lock = asyncio.Lock()
    await lock.acquire()
    request, left = leaving()
    waiting = asyncio.create_task(_lock_unless_gone(lock, request))
    await asyncio.sleep(0.01)
    return lock, waiting, left


async def test_a_client_that_leaves_while_waiting_never_takes_the_lock() -> None:
    lock, waiting, left = await waiting_for_a_held_lock()
    left.set()
    assert await waiting is False
    lock.release()
    assert not lock.locked()  # the one that left holds nothing


async def test_a_waiting_client_that_stays_takes_the_lock_once_free() -> None:
    lock, waiting, _ = await waiting_for_a_held_lock()
    lock.release()
    assert await waiting is True
    assert lock.locked()
    request, _ = leaving()
    assert await _lock_unless_gone(asyncio.Lock(), request) is True  # free: taken at once


async def test_a_waiter_cancelled_while_waiting_never_holds_the_lock() -> None:
    """The server cancels a request (its drain over): the lock it waited for must not be
    taken for it later, with nobody to give it back."""
    lock, waiting, _ = await waiting_for_a_held_lock()
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    lock.release()
    await asyncio.sleep(0.01)
    assert not lock.locked()
