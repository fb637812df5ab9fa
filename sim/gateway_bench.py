"""What the gateway costs: added latency against calling an instance directly, and the
request rate one gateway process sustains.

Emulated instances and the gateway run as their own processes (``tokenfleet emulate`` and
``tokenfleet gateway``), as users run them; this process only sends requests. Instances
run at a large speed-up with one-token answers, so a request's time is almost all HTTP and
the gateway's own work.

- **Added latency**: requests one at a time, alternating direct and through the gateway,
  so both see the same machine noise; P50 and P99 of each, and their differences.
- **Rate**: a closed loop of ``concurrency`` clients through the gateway for
  ``duration_s``, completed requests per second (``max_rps``); and the same straight to
  the instances (``direct_rps``). On a small machine the sender, the gateway and the
  instances share the cores, so ``max_rps`` is a floor for the gateway alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import numpy as np
from tqdm import tqdm

from tokenfleet.services.process import free_port

MODEL = "emulated"
KEY = "sk-bench"


def bench_gateway(
    requests: int = 1000, concurrency: int = 32, duration_s: float = 10.0, instances: int = 2
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as home, _fleet(Path(home), instances) as (direct, front):
        latency = asyncio.run(_latency(direct, front, requests))
        rate = asyncio.run(_rate([front], concurrency, duration_s))
        direct_rate = asyncio.run(_rate(direct, concurrency, duration_s))
    return {
        "requests": requests,
        "instances": instances,
        "concurrency": concurrency,
        "duration_s": duration_s,
        **latency,
        "max_rps": rate,
        "direct_rps": direct_rate,
        "cpus": os.cpu_count(),
    }


@contextlib.contextmanager
def _fleet(home: Path, instances: int) -> Iterator[tuple[list[str], str]]:
    base = free_port()
    ports = [base + n for n in range(instances)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    fleet = home / "fleet.toml"
    fleet.write_text(_fleet_file(urls))
    gateway_port = free_port()
    environment = {k: v for k, v in os.environ.items() if not k.startswith("TOKENFLEET_")} | {
        "TOKENFLEET_GATEWAY_NAME": "bench-gateway"
    }
    cli = [sys.executable, "-m", "tokenfleet.cli"]
    emulate = [*cli, "emulate", "--instances", str(instances), "--base-port", str(base)]
    processes = [
        subprocess.Popen(
            [*emulate, "--model", MODEL, "--speedup", "1000"],
            env=environment,
            stdout=subprocess.DEVNULL,
        ),
        subprocess.Popen(
            [*cli, "gateway", "--fleet", str(fleet), "--port", str(gateway_port)],
            env=environment,
            stdout=subprocess.DEVNULL,
        ),
    ]
    front = f"http://127.0.0.1:{gateway_port}"
    try:
        _wait_until_up([*urls, front])
        yield urls, front
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(30)


def _fleet_file(urls: list[str]) -> str:
    instances = "".join(
        f'[[instances]]\nid = "i{n}"\ndc = "dc"\nurl = "{url}"\nmodel = "{MODEL}"\n\n'
        for n, url in enumerate(urls)
    )
    return (
        'version = 1\n\n[[dcs]]\nname = "dc"\nregion = "here"\n\n'
        f'[[models]]\nname = "{MODEL}"\nprofile = "llama3-70b-4xh100"\n\n'
        f'{instances}[[tenants]]\nname = "bench"\napi_keys = ["{KEY}"]\n'
    )


def _wait_until_up(urls: list[str], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    for url in urls:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not come up in {timeout_s:.0f} s")
            time.sleep(0.1)


def _body(n: int) -> dict[str, Any]:
    prompt = f"request {n}: " + "a short chat message " * 10
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1}


def _session(connections: int = 100) -> aiohttp.ClientSession:
    """The sending client: aiohttp, the lightest Python client, so that the sender's own
    cost (shared with the gateway on small machines) stays low."""
    return aiohttp.ClientSession(
        headers={"authorization": f"Bearer {KEY}"},
        connector=aiohttp.TCPConnector(limit=connections),
        timeout=aiohttp.ClientTimeout(total=30),
    )


async def _post(http: aiohttp.ClientSession, base: str, n: int) -> None:
    async with http.post(f"{base}/v1/chat/completions", json=_body(n)) as response:
        await response.read()
        response.raise_for_status()


async def _latency(direct: list[str], front: str, requests: int) -> dict[str, float]:
    times: dict[str, list[float]] = {"direct": [], "gateway": []}
    async with _session() as http:
        for n in range(50):  # warm connections and caches
            await _post(http, front, n)
            await _post(http, direct[n % len(direct)], n)
        for n in tqdm(range(requests), desc="latency", unit="req"):
            for kind, base in (("direct", direct[n % len(direct)]), ("gateway", front)):
                started = time.perf_counter()
                await _post(http, base, n)
                times[kind].append(time.perf_counter() - started)
    figures = {}
    for quantile in (50, 99):
        d = float(np.percentile(times["direct"], quantile)) * 1000
        g = float(np.percentile(times["gateway"], quantile)) * 1000
        figures |= {
            f"direct_p{quantile}_ms": d,
            f"gateway_p{quantile}_ms": g,
            f"added_latency_p{quantile}_ms": g - d,
        }
    return figures


async def _rate(targets: list[str], concurrency: int, duration_s: float) -> float:
    """Completed requests per second, ``concurrency`` clients spread over ``targets``."""
    done = 0
    stop = time.monotonic() + duration_s

    async def client(http: aiohttp.ClientSession, offset: int) -> None:
        nonlocal done
        n, target = offset, targets[offset % len(targets)]
        while time.monotonic() < stop:
            await _post(http, target, n)
            done += 1
            n += concurrency

    async with _session(concurrency) as http:
        started = time.monotonic()
        await asyncio.gather(*(client(http, i) for i in range(concurrency)))
        elapsed = time.monotonic() - started
    return done / elapsed
