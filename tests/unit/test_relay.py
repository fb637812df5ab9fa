"""A relayed stream's clean-up runs however the response ends (``gateway.exchange.RelayedStream``):
its books close only there."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.requests import ClientDisconnect

from gateway.exchange import RelayedStream


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
async def test_a_stream_whose_client_left_before_its_first_event_still_ends_once(
    spec_version: str,
) -> None:
    """The server fails the response at its headers: the body is never iterated, so only
    the response itself can run the clean-up (ASGI 2.4 servers raise from ``send``)."""
    iterated: list[bytes] = []
    ended: list[bool] = []

    async def events() -> AsyncIterator[bytes]:
        iterated.append(b"started")
        yield b"data: x\n\n"

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(_: dict[str, Any]) -> None:
        raise OSError("the client left")

    response = RelayedStream(events(), on_end=lambda: ended.append(True), headers={})
    scope = {"type": "http", "asgi": {"spec_version": spec_version}}
    with contextlib.suppress(OSError, ClientDisconnect):
        await response(scope, receive, send)
    assert (iterated, ended) == ([], [True])
