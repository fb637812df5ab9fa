"""The gateway as users call it: the official openai client, in front of emulated vLLM
instances, on real loopback sockets."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse

from control.routing.cache_aware import SglangCacheAware
from control.routing.tokenpilot import INDEX_STRIDE
from control.tokens import block_hashes, chat_text
from gateway import trip
from schemas import Envelope, topic_for
from schemas.base import TaskClass
from schemas.control import AdmissionQuotas, ClassQuota
from schemas.lifecycle import RequestCancelled, RequestCompleted, RequestFailed
from schemas.openai_api import REQUEST_ID_HEADER
from schemas.telemetry import KvBlocksRemoved
from sim.emulator.server import EmulatedInstance
from tests.conftest import read_for
from tests.gateway_harness import (
    KEY,
    MODEL,
    Gateway,
    chat,
    dying_instance,
    emulated,
    fake_instance,
    fleet_for,
    gateway,
    http_server,
    scraped,
)
from tokenfleet.cli import main
from tokenfleet.services.process import free_port


async def metric(front: Gateway, name: str, **labels: str) -> float:
    return await scraped(front.url, name, **labels)


async def settled(front: Gateway, name: str, expected: float) -> float:
    """The metric once it reads ``expected`` (counted in a task of its own, it may come a
    moment after the answer), or as it reads after 2 s."""
    for _ in range(100):
        if (value := await metric(front, name)) == expected:
            return value
        await asyncio.sleep(0.02)
    return await metric(front, name)


async def test_a_streamed_chat_completion_passes_through(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello " * 200}],
        max_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert text.count("tok") == 7
    assert usage is not None
    assert usage.completion_tokens == 7


async def test_whole_completions_and_models(client: openai.AsyncOpenAI) -> None:
    answer = await client.completions.create(model=MODEL, prompt="the sky is " * 30, max_tokens=3)
    assert answer.choices[0].text == "tok " * 3
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 3
    chat_answer = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert chat_answer.choices[0].message.content == "tok tok "
    assert [m.id async for m in client.models.list()] == [MODEL]


async def test_a_workload_replays_through_the_gateway_with_a_tenant_s_key(
    front: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["replay", "--trace", "azure-conv", "--target", front.url, "--model", MODEL]
    argv += ["--requests", "6", "--speedup", "10"]
    assert await asyncio.to_thread(main, [*argv, "--api-key", KEY]) == 0
    assert await asyncio.to_thread(main, [*argv, "--api-key", "sk-wrong"]) == 1
    assert "failed: 6 with HTTP 401" in capsys.readouterr().err


async def test_a_prompt_too_long_for_its_class_objective_reaches_the_engine(
    client: openai.AsyncOpenAI,
) -> None:
    """A chat sent as interactive whose prefill alone takes past the class's 2 s
    objective on an idle fleet (60,000 tokens, which the emulated engine takes: 4 s) is
    not told to retry later, which every retry would be told again: it is served, late.
    (A text past the engine's context gets the engine's own 400, the gateway's token
    count being an estimate.)"""
    answer = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "word " * 48_000}],
        max_tokens=5,
        extra_headers={"x-tokenfleet-class": "interactive"},
    )
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 5


async def test_errors_use_openai_statuses_and_format(front: Gateway) -> None:
    async with openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key="wrong") as stranger:
        with pytest.raises(openai.AuthenticationError) as denied:
            await stranger.models.list()
    assert denied.value.status_code == 401
    async with openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key=KEY) as client:
        with pytest.raises(openai.NotFoundError) as unknown:
            await client.chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "hi"}]
            )
        assert "no-such-model" in unknown.value.message
        with pytest.raises(openai.BadRequestError) as long:
            await client.completions.create(model=MODEL, prompt=[7] * 9_000, max_tokens=10)
        assert "maximum context length is 8192" in long.value.message
        with pytest.raises(openai.BadRequestError) as malformed:
            await client.chat.completions.create(model=MODEL, messages=[], max_tokens=-1)
        assert malformed.value.body["param"] in {"messages", "max_tokens"}
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                extra_headers={"x-tokenfleet-class": "urgent"},
            )


async def test_a_request_no_allowed_dc_can_run_gets_503(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.InternalServerError) as refused:
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"x-tokenfleet-residency": "us-east"},
        )
    assert refused.value.status_code == 503


async def _apply(front: Gateway, quota: ClassQuota) -> None:
    """Publish ``quota`` for dc-a and wait until the gateway holds it."""
    quotas = AdmissionQuotas(
        version=1, scope="dc-a", issued_at=time.time(), ttl_s=60, quotas=(quota,)
    )
    bus = front.app.state.gateway.parts.bus
    await bus.publish_event(Envelope.wrap(quotas, source="test"))
    for _ in range(250):
        if front.app.state.gateway.decider.quotas.current("dc-a"):
            return
        await asyncio.sleep(0.02)
    pytest.fail("the gateway never took the quotas")


async def test_a_quota_answers_429_with_retry_after(front: Gateway) -> None:
    await _apply(
        front,
        ClassQuota(
            task_class=TaskClass.INTERACTIVE,
            tokens_per_s=10,
            burst_tokens=200,
            max_concurrency=100,
        ),
    )
    async with front.client() as http:
        first = await http.post("/v1/chat/completions", json=chat("a" * 400, max_tokens=50))
        second = await http.post("/v1/chat/completions", json=chat("a" * 400, max_tokens=50))
    assert first.status_code == 200
    assert second.status_code == 429
    assert second.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= int(second.headers["retry-after"]) <= 20


async def test_a_quota_with_a_burst_of_0_refuses_every_request(front: Gateway) -> None:
    """It took 0 tokens of 0 from the bucket and passed: a tenant shut off ran freely."""
    shut = ClassQuota(task_class=TaskClass.INTERACTIVE, tokens_per_s=0, burst_tokens=0)
    await _apply(front, shut)
    async with front.client() as http:
        refused = await http.post("/v1/chat/completions", json=chat("hi", max_tokens=5))
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "60"  # the wait for a bucket that never fills


async def test_a_refused_request_gives_its_quota_tokens_back(front: Gateway) -> None:
    """No DC may run the first request (its residency): refused after it took its tokens,
    it kept them, and its client's retry found the bucket empty, charged twice."""
    quota = ClassQuota(task_class=TaskClass.INTERACTIVE, tokens_per_s=1, burst_tokens=200)
    await _apply(front, quota)
    body = chat("a" * 400, max_tokens=50)  # larger than the bucket: it takes all of it
    async with front.client() as http:
        elsewhere = {"x-tokenfleet-residency": "us-east"}
        refused = await http.post("/v1/chat/completions", json=body, headers=elsewhere)
        retried = await http.post("/v1/chat/completions", json=body)
    assert (refused.status_code, retried.status_code) == (503, 200)


async def test_kv_events_correct_the_shared_prefix_index(front: Gateway) -> None:
    prompt = "the same long system prompt " * 40
    messages = chat(prompt)["messages"]
    blocks = block_hashes(chat_text(messages))
    state, bus = front.app.state.gateway.parts.state, front.app.state.gateway.parts.bus
    async with front.client() as http:
        assert (await http.post("/v1/chat/completions", json=chat(prompt))).status_code == 200

    async def matched() -> list[int]:
        return (
            await state.view(["i0", "i1"], blocks[INDEX_STRIDE - 1 :: INDEX_STRIDE])
        ).matched_blocks.tolist()

    assert max(await matched()) > 0
    for instance in ("i0", "i1"):
        removed = KvBlocksRemoved(instance_id=instance, block_hashes=blocks)
        await bus.publish_event(Envelope.wrap(removed, source="test"))
    for _ in range(100):
        if await matched() == [0, 0]:
            break
        await asyncio.sleep(0.02)
    assert await matched() == [0, 0]


async def test_a_whole_answer_stops_counting_its_prefill_at_the_predicted_first_token() -> None:
    """A non-streamed answer shows no first token; its prefill must not count as pending
    on its instance for the whole of its decode."""
    async with emulated(1, speedup=5.0) as [instance], gateway(fleet_for([instance.url])) as front:
        state = front.app.state.gateway.parts.state
        async with front.client() as http:
            answer = asyncio.create_task(
                http.post("/v1/chat/completions", json=chat("word " * 1000, max_tokens=400))
            )
            samples = []
            while not answer.done():
                view = await state.view(["i0"], [])
                samples.append((view.pending_prefill[0], view.inflight_tokens[0]))
                await asyncio.sleep(0.01)
            assert (await answer).status_code == 200
        end = await state.view(["i0"], [])
    first_pending = next(n for n, (pending, _) in enumerate(samples) if pending > 0)
    assert any(pending == 0 and inflight > 0 for pending, inflight in samples[first_pending:])
    assert (end.pending_prefill[0], end.inflight_tokens[0]) == (0, 0)


async def test_routers_see_when_each_instance_last_streamed_a_token(front: Gateway) -> None:
    """A streamed token marks the end of one of its instance's steps, which TokenPilot
    reads as where the next one began; a whole answer shows none."""
    view = front.app.state.gateway.view
    pool = view.pool(MODEL, view.dcs_serving(MODEL)[0])

    async def step_ends() -> dict[str, float]:
        shared = await front.app.state.gateway.parts.state.view(pool.ids, [])
        return dict(zip(pool.ids, view.snapshot(pool, shared).last_step_end_s, strict=True))

    async with front.client() as http:
        whole = await http.post("/v1/chat/completions", json=chat("hi " * 50))
        assert whole.status_code == 200
        assert all(end == -float("inf") for end in (await step_ends()).values())
        started = time.monotonic()
        streamed = await http.post("/v1/chat/completions", json=chat("hi " * 50, stream=True))
        ended = time.monotonic()
    ends = await step_ends()
    instance = streamed.headers["x-tokenfleet-instance"]
    assert started < ends[instance] <= ended
    assert all(end == -float("inf") for other, end in ends.items() if other != instance)


async def test_an_instance_that_stops_answering_is_left_out() -> None:
    async with emulated(1) as [alive]:
        dead = f"http://127.0.0.1:{free_port()}"
        async with gateway(fleet_for([dead, alive.url]), policy="round_robin") as front:
            view = front.app.state.gateway.view
            for _ in range(100):  # the collector's first round marks it not ready
                if not view.ready("i0"):
                    break
                await asyncio.sleep(0.02)
            async with front.client() as http:
                answers = [
                    await http.post("/v1/chat/completions", json=chat(f"{n} " * 50))
                    for n in range(4)
                ]
            assert [a.status_code for a in answers] == [200] * 4
            assert {a.headers["x-tokenfleet-instance"] for a in answers} == {"i1"}
            assert await metric(front, "tokenfleet_gateway_retries_total") == 0


def _breaking_upstream(tokens_before_break: int) -> Starlette:
    """An instance whose streams die after some tokens (the connection drops)."""
    chunk = {"choices": [{"index": 0, "text": "tok ", "finish_reason": None}]}
    return dying_instance(
        "/v1/completions", [f"data: {json.dumps(chunk)}\n\n".encode()] * tokens_before_break
    )


async def test_a_stream_broken_after_tokens_ends_with_an_error_not_a_rerun() -> None:
    async with http_server(_breaking_upstream(3)) as broken, emulated(1) as [alive]:
        fleet = fleet_for([broken, alive.url])
        async with gateway(fleet, policy="round_robin") as front, front.client() as http:
            body = {"model": MODEL, "prompt": "x " * 40, "max_tokens": 8, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                events = [line async for line in response.aiter_lines() if line]
            assert response.headers["x-tokenfleet-instance"] == "i0"
            assert len(events) == 5  # three tokens, the error, then the end as vLLM ends
            assert json.loads(events[-2][len("data: ") :])["error"]["code"] == 502
            assert events[-1] == "data: [DONE]"
            assert await metric(front, "tokenfleet_gateway_retries_total") == 0


async def test_a_stream_broken_before_its_first_token_is_retried_elsewhere() -> None:
    async with http_server(_breaking_upstream(0)) as broken, emulated(1) as [alive]:
        fleet = fleet_for([broken, alive.url])
        async with gateway(fleet, policy="round_robin") as front, front.client() as http:
            body = {"model": MODEL, "prompt": "x " * 40, "max_tokens": 3, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                events = [line async for line in response.aiter_lines() if line]
            assert response.headers["x-tokenfleet-instance"] == "i1"
            assert events[-1] == "data: [DONE]"
            assert len(events) == 4
            assert await metric(front, "tokenfleet_gateway_retries_total") == 1


async def test_a_tenant_s_key_from_the_environment_lets_its_clients_in(
    instances: list[EmulatedInstance], monkeypatch: pytest.MonkeyPatch
) -> None:
    tenants = [{"name": "env-tenant", "api_keys_env": ["TEAM_KEY"]}]
    fleet = fleet_for([i.url for i in instances], tenants=tenants)
    with pytest.raises(ValueError, match="TEAM_KEY"):
        async with gateway(fleet):
            pass  # unset: the gateway refuses to start
    monkeypatch.setenv("TEAM_KEY", "sk-from-env")
    async with gateway(fleet) as front:
        async with front.client("sk-from-env") as http:
            let_in = await http.post("/v1/chat/completions", json=chat("hi " * 10))
        async with front.client() as http:  # the harness's KEY, no tenant's here
            kept_out = await http.post("/v1/chat/completions", json=chat("hi " * 10))
    assert let_in.status_code == 200
    assert kept_out.status_code == 401


async def test_an_idempotency_key_returns_the_first_outcome(
    front: Gateway, instances: list[EmulatedInstance]
) -> None:
    headers = {"idempotency-key": "order-42"}
    async with front.client() as http:
        first = await http.post("/v1/chat/completions", json=chat("pay " * 30), headers=headers)
        again = await http.post("/v1/chat/completions", json=chat("pay " * 30), headers=headers)
    assert again.status_code == 200
    assert again.json() == first.json()
    assert again.headers["idempotent-replayed"] == "true"
    # the first request's: its id (which its events carry), where it ran
    for said in (REQUEST_ID_HEADER, "x-tokenfleet-instance", "x-tokenfleet-dc"):
        assert again.headers[said] == first.headers[said]
    assert (
        sum([await scraped(i.url, "vllm:e2e_request_latency_seconds_count") for i in instances])
        == 1
    )


async def test_an_idempotency_key_sent_with_another_request_runs_that_request(
    front: Gateway,
) -> None:
    """The first request's answer came back for any request under the same key: a chat's
    to an embeddings call, a stream to a whole request, the first prompt's to another."""
    headers = {"idempotency-key": "order-43"}
    async with front.client() as http:
        first = await http.post("/v1/chat/completions", json=chat("pay " * 30), headers=headers)
        other = await http.post("/v1/chat/completions", json=chat("buy " * 30), headers=headers)
        streamed = await http.post(
            "/v1/chat/completions", json=chat("pay " * 30, stream=True), headers=headers
        )
        embedded = await http.post(
            "/v1/embeddings", json={"model": MODEL, "input": "pay"}, headers=headers
        )
    assert first.status_code == other.status_code == 200
    assert "idempotent-replayed" not in other.headers
    assert other.json()["id"] != first.json()["id"]
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert embedded.json()["object"] == "list"


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_too_large_to_keep_is_not_run_again(
    front: Gateway,
    instances: list[EmulatedInstance],
    monkeypatch: pytest.MonkeyPatch,
    stream: bool,
) -> None:
    """A 24 MB answer kept under its key timed the retry's claim out in Redis, and the
    retry ran again; past ``KEPT_ANSWER_BYTES`` the retry gets a 409 saying why."""
    monkeypatch.setattr(trip, "KEPT_ANSWER_BYTES", 64)
    headers, body = {"idempotency-key": "order-44"}, chat("pay " * 30, stream=stream)
    async with front.client() as http:
        first = await http.post("/v1/chat/completions", json=body, headers=headers)
        again = await http.post("/v1/chat/completions", json=body, headers=headers)
    assert first.status_code == 200
    assert len(first.content) > 64
    assert again.status_code == 409
    assert again.headers["idempotent-replayed"] == "true"
    assert "too large to keep" in again.json()["error"]["message"]
    assert (
        sum([await scraped(i.url, "vllm:e2e_request_latency_seconds_count") for i in instances])
        == 1
    )


async def test_headers_past_their_bounds_are_refused_and_hold_no_key(front: Gateway) -> None:
    """A region longer than an event carries failed the request's arrival event with a
    server error, and left its idempotency key held (409 to every retry for 10 minutes)."""
    key = {"idempotency-key": "order-43"}
    long_region = {"x-tokenfleet-residency": "r" * 300, **key}
    async with front.client() as http:
        refused = [
            await http.post("/v1/chat/completions", json=chat("hi"), headers=headers)
            for headers in (long_region, {"idempotency-key": "k" * 300})
        ]
        retried = await http.post("/v1/chat/completions", json=chat("hi"), headers=key)
    assert [r.status_code for r in refused] == [400, 400]
    assert [r.json()["error"]["param"] for r in refused] == [
        "x-tokenfleet-residency",
        "idempotency-key",
    ]
    assert retried.status_code == 200


async def test_a_client_that_leaves_cancels_the_upstream_request(
    front: Gateway, instances: list[EmulatedInstance]
) -> None:
    body = chat("long " * 100, max_tokens=5000, stream=True)
    async with (
        front.client() as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        async for line in response.aiter_lines():
            if "tok" in line:
                break
    await _cancelled_upstream(front, instances)


async def _cancelled_upstream(front: Gateway, instances: list[EmulatedInstance]) -> None:
    """Until the engines run nothing and the gateway counted one cancellation; fails if
    either does not come."""
    engines = [i.driver.engine for i in instances]
    for _ in range(200):
        if not any(e.running or e.waiting for e in engines):
            break
        await asyncio.sleep(0.02)
    assert not any(e.running or e.waiting for e in engines)
    assert await settled(front, "tokenfleet_gateway_cancellations_total", 1) == 1


async def test_a_client_that_leaves_before_a_whole_answer_cancels_it_upstream(
    front: Gateway, instances: list[EmulatedInstance]
) -> None:
    """A whole answer's headers come with its end: the client is watched from the start,
    so it is not generated to the end and reported completed for nobody."""
    body = chat("long " * 100, max_tokens=5000)
    async with front.client() as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/chat/completions", json=body, timeout=0.5)
    await _cancelled_upstream(front, instances)
    bus = front.app.state.gateway.parts.bus
    events = await read_for(bus, topic_for(RequestCompleted).name, 0.3)
    assert not [e for e in events if isinstance(e, RequestCompleted)]
    cancelled = await read_for(bus, topic_for(RequestCancelled).name, 0.3)
    [event] = [e for e in cancelled if isinstance(e, RequestCancelled)]
    assert (event.dc, event.task_class, event.tenant) == ("dc-a", TaskClass.INTERACTIVE, "tenant-a")


async def test_a_client_that_leaves_before_a_stream_s_first_token_cancels_it_upstream() -> None:
    """A stream's headers go out with its first token (a failure before it may still
    go to another instance): until then its client is watched as a whole answer's is, so
    a queue wait or a long prefill is aborted upstream when it leaves."""
    reached, closed = asyncio.Event(), asyncio.Event()

    async def no_token_yet(_: Request) -> StreamingResponse:
        reached.set()

        async def waiting() -> AsyncIterator[bytes]:
            try:
                await asyncio.sleep(60)
                yield b"data: [DONE]\n\n"
            finally:
                closed.set()  # the gateway closed the connection

        return StreamingResponse(waiting(), media_type="text/event-stream")

    async with (
        http_server(fake_instance("/v1/chat/completions", no_token_yet)) as url,
        gateway(fleet_for([url])) as front,
        front.client() as http,
    ):
        asking = asyncio.create_task(
            http.post("/v1/chat/completions", json=chat("hi", stream=True))
        )
        await asyncio.wait_for(reached.wait(), 10)  # the instance has it: the client leaves
        asking.cancel()
        await asyncio.gather(asking, return_exceptions=True)
        await asyncio.wait_for(closed.wait(), 5)
        assert await settled(front, "tokenfleet_gateway_cancellations_total", 1) == 1


async def test_a_request_the_gateway_gives_up_is_reported_failed_and_counts_nothing(
    front: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unexpected exception on the way to the instance (a bug; a cancellation where
    the server stops) ends the request with a failure event, so the tables count what
    its client did not get, and leaves nothing counted on the instance."""
    exchange = front.app.state.gateway.exchange

    async def broken(*_: object, **__: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(exchange, "_post", broken)
    async with front.client() as http:
        answer = await http.post("/v1/chat/completions", json=chat("give up " * 10))
    assert answer.status_code == 500
    failed = await read_for(front.app.state.gateway.parts.bus, topic_for(RequestFailed).name, 0.3)
    [event] = [e for e in failed if isinstance(e, RequestFailed)]
    assert event.error == "the gateway gave it up (RuntimeError)"
    state = front.app.state.gateway.parts.state
    for _ in range(100):
        view = await state.view(["i0", "i1"], [])
        if not view.inflight_tokens.any():
            break
        await asyncio.sleep(0.02)
    assert not view.inflight_tokens.any()
    assert not view.pending_prefill.any()


async def test_a_stream_is_in_progress_until_its_last_event(front: Gateway) -> None:
    in_progress = "tokenfleet_gateway_requests_in_progress"
    body = chat("count me " * 20, max_tokens=200, stream=True)
    async with (
        front.client() as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        lines = response.aiter_lines()
        async for line in lines:
            if "tok" in line:
                break
        during = await metric(front, in_progress)
        [line async for line in lines]
    assert (during, await settled(front, in_progress, 0)) == (1, 0)


async def test_a_completion_says_whether_it_was_streamed(front: Gateway) -> None:
    """A whole answer's first token is unseen: its event says so, and the tables judge it
    on its end."""
    async with front.client() as http:
        for stream in (False, True):
            body = chat(f"streamed {stream} " * 10, max_tokens=3, stream=stream)
            assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
    events = await read_for(
        front.app.state.gateway.parts.bus, topic_for(RequestCompleted).name, 0.3
    )
    assert [e.streamed for e in events if isinstance(e, RequestCompleted)] == [False, True]


async def test_the_embedded_gateway_keeps_goodput_tables_of_its_requests(
    instances: list[EmulatedInstance], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENFLEET_WORKER_SLIDE_S", "0.5")
    monkeypatch.setenv("TOKENFLEET_WORKER_WINDOW_S", "30")
    monkeypatch.setenv("TOKENFLEET_WORKER_PUBLISH_S", "0.2")
    async with gateway(fleet_for([i.url for i in instances])) as front, front.client() as http:
        for n in range(5):
            body = chat(f"count me {n} " * 20, max_tokens=3, stream=n % 2 == 0)
            assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        bus = front.app.state.gateway.parts.bus
        completed, tokens = 0, 0
        for _ in range(100):
            latest = (await bus.read_latest("tf.tables.goodput")).get("dc-a")
            if latest is not None:
                row = latest.payload.classes[0]
                completed, tokens = row.completed, row.output_tokens
                if completed == 5:
                    break
            await asyncio.sleep(0.1)
    assert (completed, tokens) == (5, 15)


def test_the_gateway_on_a_taken_port_exits_2_with_a_message(
    taken_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = Path(__file__).parents[2] / "examples" / "fleet.toml"
    argv = ["gateway", "--fleet", str(fleet), "--host", "127.0.0.1", "--port", str(taken_port)]
    assert main(argv) == 2
    assert "the gateway cannot start" in capsys.readouterr().err


async def test_a_router_that_counts_its_own_requests_hears_of_their_end(
    instances: list[EmulatedInstance],
) -> None:
    """SGLang's router counts the requests it sent until each ends: through the gateway,
    streamed or whole, the count comes back to zero."""
    async with (
        gateway(fleet_for([i.url for i in instances]), policy="sglang_cache_aware") as front,
        front.client() as http,
    ):
        for n in range(4):
            body = chat(f"count {n} " * 30, max_tokens=3, stream=n % 2 == 0)
            assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        router = front.app.state.gateway.decider.router(MODEL, "dc-a")
        for _ in range(100):
            if router.inflight.counts(2).tolist() == [0, 0]:
                break
            await asyncio.sleep(0.02)
    assert isinstance(router, SglangCacheAware)
    assert router.inflight.counts(2).tolist() == [0, 0]


async def test_a_router_s_count_comes_back_after_refusals_and_broken_streams() -> None:
    async def refuse(_: Request) -> StreamingResponse:
        return StreamingResponse(iter([b'{"error": {"message": "no"}}']), status_code=400)

    async with (
        http_server(fake_instance("/v1/chat/completions", refuse)) as refusing,
        http_server(_breaking_upstream(2)) as breaking,
    ):
        fleet = fleet_for([refusing, breaking])
        async with (
            gateway(fleet, policy="sglang_cache_aware") as front,
            front.client() as http,
        ):
            assert (await http.post("/v1/chat/completions", json=chat("x " * 20))).status_code
            body = {"model": MODEL, "prompt": "y " * 40, "max_tokens": 8, "stream": True}
            for _ in range(3):
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    [line async for line in response.aiter_lines()]
            router = front.app.state.gateway.decider.router(MODEL, "dc-a")
            for _ in range(100):
                if router.inflight.counts(2).tolist() == [0, 0]:
                    break
                await asyncio.sleep(0.02)
            assert router.inflight.counts(2).tolist() == [0, 0]
