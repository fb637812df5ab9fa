"""The floor under the gateway's cost: a proxy on the same stack that does nothing else.

uvicorn serving a bare ASGI app that forwards each POST, body as it is, to the next
instance in turn through one aiohttp session, on uvloop, as the gateway runs. No routing,
accounting, events or metrics beyond ``/metrics``' process figures. The gateway bench
measures it beside the gateway: whatever the gateway costs beyond it is its own work.
Run as ``python -m tokenfleet.bare_proxy PORT URL[,URL...]``.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any

import aiohttp
import uvicorn
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest

from tokenfleet.commands.loop import run_fast

_JSON = [(b"content-type", b"application/json")]


class BareProxy:
    def __init__(self, upstreams: list[str]) -> None:
        self.upstreams = itertools.cycle(upstreams)
        self.session: aiohttp.ClientSession | None = None
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["method"] == "POST":
            body = await _body(receive)
            assert self.session is not None
            url = next(self.upstreams) + scope["path"]
            async with self.session.post(
                url, data=body, headers={"content-type": "application/json"}
            ) as answer:
                await _respond(send, answer.status, await answer.read())
        elif scope["path"] == "/metrics":
            await _respond(send, 200, generate_latest(self.registry))
        else:
            await _respond(send, 200, b"{}")

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.session = aiohttp.ClientSession()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.session is not None:
                    await self.session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _body(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _respond(send: Any, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": _JSON})
    await send({"type": "http.response.body", "body": body})


def main() -> None:
    port, upstreams = int(sys.argv[1]), sys.argv[2].split(",")
    config = uvicorn.Config(
        BareProxy(upstreams), host="127.0.0.1", port=port, log_level="warning", access_log=False
    )
    run_fast(uvicorn.Server(config).serve())


if __name__ == "__main__":
    main()
