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
  instances share the cores, so ``max_rps`` is a floor for the gateway alone. The
  gateway's CPU time over its run (``process_cpu_seconds_total`` from its ``/metrics``)
  per request gives ``gateway_cpu_ms_per_request``: what one request costs it, whoever
  else shares the cores. With Redis, ``redis_calls_per_request``: the round trips to it
  per request served over the rate run (the decision's, the first token's and the end's,
  and the admission loads the release passes share).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from redis import Redis

from sim.profiles import DEFAULT_PROFILE
from sim.progress import progress_bar
from tokenfleet.services.process import (
    answers_http,
    free_port,
    free_ports,
    http_service,
    python_module,
    read_http,
)

MODEL = "emulated"
KEY = "sk-bench"


def bench_gateway(
    requests: int = 1000,
    concurrency: int = 32,
    duration_s: float = 10.0,
    instances: int = 2,
    litellm: str | None = None,
    redis: str | None = None,
    journal: bool = False,
) -> dict[str, Any]:
    """Figures for our gateway with SLOMax, its default (top-level keys), for the same
    gateway admitting everything (under ``gateway_fcfs``: what admission costs), with its
    state in the Redis at URL ``redis`` (under ``gateway_redis``; and two such replicas
    sharing it, the clients split between them, under ``gateway_redis_pair``), for a bare
    pass-through proxy on the same stack (under ``bare_proxy``, ``tokenfleet.bare_proxy``: the floor
    under the gateway's cost) and, with the path of LiteLLM's ``litellm`` command, for its
    proxy in front of the same instances (under ``litellm``); with ``journal``, for the
    gateway keeping its decision journal in a file (under ``gateway_journal``)."""
    with tempfile.TemporaryDirectory() as home, contextlib.ExitStack() as stack:
        direct = stack.enter_context(_instances(Path(home), instances))
        fronts = {
            "gateway": stack.enter_context(_gateway(Path(home), direct, "slomax", "gateway")),
            "gateway_fcfs": stack.enter_context(
                _gateway(Path(home), direct, "fcfs", "gateway_fcfs")
            ),
            "bare_proxy": stack.enter_context(_bare_proxy(Path(home), direct)),
        }
        pair: list[str] = []
        if redis:
            shared = f"bench-{uuid.uuid4().hex[:8]}:"
            pair = [
                stack.enter_context(
                    _gateway(Path(home), direct, "slomax", name, redis, prefix=shared)
                )
                for name in ("gateway_redis", "gateway_redis_b")
            ]
            fronts["gateway_redis"] = pair[0]
        if journal:
            fronts["gateway_journal"] = stack.enter_context(
                _gateway(Path(home), direct, "slomax", "gateway_journal", journal=True)
            )
        if litellm:
            fronts["litellm"] = stack.enter_context(_litellm(Path(home), litellm, direct))
        latency = asyncio.run(_latency(direct, fronts, requests))
        measured = {
            name: _measured(
                [url],
                concurrency,
                duration_s,
                cpu=name in _MEASURED_CPU,
                redis=redis if name == "gateway_redis" else None,
            )
            for name, url in fronts.items()
        }
        if pair:  # both replicas of one Redis, each taking half the clients
            together = _measured(pair, concurrency, duration_s, cpu=True, redis=redis)
        direct_rate = asyncio.run(_rate(direct, concurrency, duration_s))
    figures = {
        "requests": requests,
        "instances": instances,
        "concurrency": concurrency,
        "duration_s": duration_s,
        "direct_p50_ms": latency["direct"][50],
        "direct_p99_ms": latency["direct"][99],
        "direct_rps": direct_rate.per_s,
        "gateway_cpu_ms_per_request": measured["gateway"]["cpu_ms_per_request"],
        "cpus": os.cpu_count(),
    }
    if pair:
        one_replica = measured["gateway_redis"]["max_rps"]
        figures["gateway_redis_pair"] = together | {
            "rate_over_one_replica": together["max_rps"] / one_replica
        }
    for name in fronts:
        added = {
            f"added_latency_p{q}_ms": latency[name][q] - latency["direct"][q] for q in (50, 99)
        }
        own = {f"p{q}_ms": latency[name][q] for q in (50, 99)} | added | measured[name]
        if name == "gateway":
            figures |= added | {"max_rps": own["max_rps"], "gateway_p50_ms": own["p50_ms"]}
            figures["gateway_p99_ms"] = own["p99_ms"]
        else:
            figures[name] = own
    return figures


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TOKENFLEET_")}


@contextlib.contextmanager
def _instances(home: Path, count: int) -> Iterator[list[str]]:
    base = free_ports(count)
    urls = [f"http://127.0.0.1:{base + n}" for n in range(count)]
    argv = [*_CLI, "emulate", "--instances", str(count), "--base-port", str(base)]
    argv += ["--model", MODEL, "--speedup", "1000"]
    with http_service(home / "instances", argv, urls[-1], env=_environment()):
        if not all(answers_http(f"{url}/health") for url in urls):
            raise RuntimeError("an emulated instance did not come up")
        yield urls


@contextlib.contextmanager
def _gateway(
    home: Path,
    instances: list[str],
    admission: str,
    name: str,
    redis: str | None = None,
    *,
    journal: bool = False,
    prefix: str | None = None,
) -> Iterator[str]:
    """A gateway process; with ``redis``, its state there under ``prefix`` (replicas of
    one fleet share one; default: a prefix of its own)."""
    fleet = home / "fleet.toml"
    fleet.write_text(_fleet_file(instances))
    port = free_port()
    argv = [*_CLI, "gateway", "--fleet", str(fleet), "--port", str(port)]
    argv += ["--admission", admission]
    env = _environment() | {"TOKENFLEET_GATEWAY_NAME": name}
    if journal:  # no Kafka here: to a file, as an embedded gateway keeps it
        env |= {"TOKENFLEET_GATEWAY_JOURNAL_FILE": str(home / f"{name}.journal.jsonl")}
    if redis:
        shared = prefix or f"bench-{port}:"
        env |= {"TOKENFLEET_REDIS_URL": redis, "TOKENFLEET_GATEWAY_REDIS_PREFIX": shared}
    with http_service(home / name, argv, f"http://127.0.0.1:{port}", env=env) as url:
        yield url


@contextlib.contextmanager
def _bare_proxy(home: Path, instances: list[str]) -> Iterator[str]:
    port = free_port()
    argv = [*python_module("tokenfleet.bare_proxy"), str(port), ",".join(instances)]
    with http_service(home / "bare", argv, f"http://127.0.0.1:{port}", env=_environment()) as url:
        yield url


def litellm_command() -> str | None:
    """LiteLLM's ``litellm`` command when installed (``pip install tokenfleet[litellm]``
    puts it beside this interpreter), else one on the PATH."""
    beside = Path(sys.executable).parent / "litellm"
    return str(beside) if beside.exists() else shutil.which("litellm")


@contextlib.contextmanager
def _litellm(home: Path, command: str, instances: list[str]) -> Iterator[str]:
    """LiteLLM's proxy with one deployment per instance (its default shuffle router)."""
    config = home / "litellm.yaml"
    deployments = "".join(
        f"  - model_name: {MODEL}\n    litellm_params:\n      model: openai/{MODEL}\n"
        f"      api_base: {url}/v1\n      api_key: unused\n"
        for url in instances
    )
    config.write_text(f"model_list:\n{deployments}general_settings:\n  master_key: {KEY}\n")
    port = free_port()
    argv = [command, "--config", str(config), "--port", str(port), "--num_workers", "1"]
    env = _environment() | {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
    url = f"http://127.0.0.1:{port}"
    with http_service(home / "litellm", argv, url, health="/health/liveliness", env=env):
        yield url


_CLI = python_module("tokenfleet")
_MEASURED_CPU = ("gateway", "gateway_fcfs", "gateway_redis", "gateway_journal", "bare_proxy")
"""Fronts whose ``/metrics`` carry ``process_cpu_seconds_total``."""


def _fleet_file(urls: list[str]) -> str:
    instances = "".join(
        f'[[instances]]\nid = "i{n}"\ndc = "dc"\nurl = "{url}"\nmodel = "{MODEL}"\n\n'
        for n, url in enumerate(urls)
    )
    return (
        'version = 1\n\n[[dcs]]\nname = "dc"\nregion = "here"\n\n'
        f'[[models]]\nname = "{MODEL}"\nprofile = "{DEFAULT_PROFILE}"\n\n'
        f'{instances}[[tenants]]\nname = "bench"\napi_keys = ["{KEY}"]\n'
    )


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


async def _latency(
    direct: list[str], fronts: dict[str, str], requests: int
) -> dict[str, dict[int, float]]:
    """P50 and P99 in ms per target, requests one at a time, targets taking turns."""
    times: dict[str, list[float]] = {"direct": [], **{name: [] for name in fronts}}
    async with _session() as http:
        for n in range(50):  # warm connections and caches
            for base in [direct[n % len(direct)], *fronts.values()]:
                await _post(http, base, n)
        for n in progress_bar(range(requests), desc="latency", unit="req"):
            for name, base in (("direct", direct[n % len(direct)]), *fronts.items()):
                started = time.perf_counter()
                await _post(http, base, n)
                times[name].append(time.perf_counter() - started)
    return {
        name: {q: float(np.percentile(samples, q)) * 1000 for q in (50, 99)}
        for name, samples in times.items()
    }


@dataclass(frozen=True)
class Rate:
    requests: int
    seconds: float

    @property
    def per_s(self) -> float:
        return self.requests / self.seconds


async def _rate(targets: list[str], concurrency: int, duration_s: float) -> Rate:
    """Requests completed by ``concurrency`` clients spread over ``targets``."""
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
        return Rate(done, time.monotonic() - started)


def _measured(
    urls: list[str], concurrency: int, duration_s: float, *, cpu: bool, redis: str | None
) -> dict[str, float]:
    """A rate run on ``urls``: requests per second (``max_rps``); with ``cpu``, the CPU
    time of their processes together per request; with ``redis``, the scripts that Redis
    ran per request."""
    cpu_before = sum(_cpu_seconds(url) for url in urls) if cpu else 0.0
    calls_before = _script_calls(redis) if redis else 0
    rate = asyncio.run(_rate(urls, concurrency, duration_s))
    figures = {"max_rps": rate.per_s}
    if cpu:
        used = sum(_cpu_seconds(url) for url in urls) - cpu_before
        figures["cpu_ms_per_request"] = used * 1000 / rate.requests
    if redis:
        figures["redis_calls_per_request"] = (_script_calls(redis) - calls_before) / rate.requests
    return figures


def _script_calls(redis: str) -> int:
    """Scripts Redis has run for its clients so far (``INFO commandstats``): the gateway
    reaches its shared state through scripts only, one call a round trip (the commands a
    script runs are counted apart, under their own names)."""
    client = Redis.from_url(redis)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    scripts = (stats.get(f"cmdstat_{name}", {}) for name in ("evalsha", "eval"))
    return sum(int(stat.get("calls", 0)) for stat in scripts)


def _cpu_seconds(front: str) -> float:
    """The CPU time a front's process has used so far, from its ``/metrics``."""
    for line in read_http(f"{front}/metrics").splitlines():
        if line.startswith("process_cpu_seconds_total "):
            return float(line.split()[1])
    raise RuntimeError(f"{front}/metrics has no process_cpu_seconds_total")
