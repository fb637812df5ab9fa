"""Everything a vLLM server answers passes through the gateway, as the official openai
client sees it: tool calls, reasoning, the Responses API, embeddings, several prompts,
the model routes, and bad input answered in OpenAI's format."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import numpy as np
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from control.tokens import count_tokens
from schemas.lifecycle import FirstToken, RequestCompleted
from sim.emulator.answers import EMBEDDING_DIMENSION, reasoning_tokens
from sim.emulator.server import EmulatedInstance
from tests.gateway_harness import (
    KEY,
    MODEL,
    WEATHER,
    Gateway,
    chat,
    chat_answer,
    emulated,
    fake_instance,
    fleet_for,
    gateway,
    http_server,
    latest_event,
    scraped,
    streaming_instance,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


async def test_a_streamed_tool_call_passes_through_and_fails_no_instance() -> None:
    async with (
        emulated(1) as [instance],
        gateway(fleet_for([instance.url])) as front,
        openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key=KEY) as client,
    ):
        for _ in range(3):  # a failed instance would be left out: the next would get 503
            stream = await client.chat.completions.create(
                model=MODEL, messages=WEATHER, tools=TOOLS, max_tokens=6, stream=True
            )
            name, arguments, finish, content = "", "", None, ""
            async for chunk in stream:
                delta = chunk.choices[0].delta
                content += delta.content or ""
                for call in delta.tool_calls or ():
                    name += call.function.name or "" if call.function else ""
                    arguments += call.function.arguments or "" if call.function else ""
                finish = chunk.choices[0].finish_reason or finish
            assert (name, finish, content) == ("get_weather", "tool_calls", "")
            assert json.loads(arguments) == {"text": "tok " * 6}
        assert await scraped(front.url, "tokenfleet_gateway_requests_total", status="200") == 3
        assert await scraped(front.url, "tokenfleet_gateway_upstream_errors_total") == 0


async def test_a_whole_tool_call_and_a_named_tool_choice(client: openai.AsyncOpenAI) -> None:
    tools = [*TOOLS, {"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    answer = await client.chat.completions.create(
        model=MODEL,
        messages=WEATHER,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=3,
    )
    message = answer.choices[0].message
    assert message.content is None
    assert message.tool_calls is not None
    assert [c.function.name for c in message.tool_calls] == ["get_time"]
    assert json.loads(message.tool_calls[0].function.arguments) == {"text": "tok " * 3}
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 3


async def test_reasoning_deltas_pass_through_as_they_come_and_are_the_first_token() -> None:
    """The first chunk reaches the client while the engine is still reasoning, and the
    gateway's first token is that chunk: nothing waits for the first content."""
    budget = 400
    async with (
        emulated(1, speedup=2.0, reasoning=True) as [instance],
        gateway(fleet_for([instance.url])) as front,
        front.client() as http,
    ):
        body = chat("think " * 50, max_tokens=budget, stream=True)
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = aiter(response.aiter_lines())
            first: dict[str, str] = {}
            while "role" in first or not first:  # the role chunk leads, as vLLM sends it
                if (line := await anext(lines)).startswith("data:"):
                    first = json.loads(line[len("data:") :])["choices"][0]["delta"]
            generated = instance.driver.engine.running[0].generated
            request_id = response.headers["x-tokenfleet-request-id"]
            first_token = await latest_event(front, request_id, FirstToken)
            still_thinking = instance.driver.engine.running[0].generated
    assert first == {"reasoning_content": "tok "}
    assert generated < reasoning_tokens(budget)
    assert first_token is not None
    assert still_thinking < reasoning_tokens(budget)  # counted before any content existed


async def test_an_answer_that_is_all_reasoning_is_an_answer() -> None:
    async with (
        emulated(1, reasoning=True) as [instance],
        gateway(fleet_for([instance.url])) as front,
        openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key=KEY) as client,
    ):
        for _ in range(2):
            stream = await client.chat.completions.create(
                model=MODEL, messages=WEATHER, max_tokens=1, stream=True
            )
            chunks = [chunk async for chunk in stream]
            assert [getattr(c.choices[0].delta, "reasoning_content", None) for c in chunks] == [
                None,
                "tok ",
            ]
            assert all(not c.choices[0].delta.content for c in chunks)
        whole = await client.chat.completions.create(model=MODEL, messages=WEATHER, max_tokens=4)
    assert getattr(whole.choices[0].message, "reasoning_content", None) == "tok " * 2
    assert whole.choices[0].message.content == "tok " * 2


def _empty_upstream() -> Starlette:
    """An instance whose model ends its answer at once (end of text as the first token)."""
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": MODEL}
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    stop = {"index": 0, "delta": {}, "finish_reason": "stop"}
    return streaming_instance([{**base, "choices": [role]}, {**base, "choices": [stop]}])


async def test_an_empty_answer_is_passed_on_and_completes() -> None:
    async with (
        http_server(_empty_upstream()) as upstream,
        gateway(fleet_for([upstream])) as front,
        openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key=KEY) as client,
    ):
        for _ in range(2):
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=WEATHER, stream=True
            )
            chunks = [chunk async for chunk in raw.parse()]
            assert [c.choices[0].finish_reason for c in chunks] == [None, "stop"]
        request_id = raw.headers["x-tokenfleet-request-id"]
        completed = await latest_event(front, request_id, RequestCompleted)
        assert completed is not None
        assert completed.output_tokens == 0
        assert await scraped(front.url, "tokenfleet_gateway_retries_total") == 0


async def test_the_responses_api_streams_and_answers_whole(
    front: Gateway, client: openai.AsyncOpenAI
) -> None:
    stream = await client.responses.create(
        model=MODEL,
        instructions="Answer briefly.",
        input="Name three rivers. " * 20,
        max_output_tokens=5,
        stream=True,
    )
    kinds, text, usage = [], "", None
    async for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type == "response.completed":
            usage = event.response.usage
    assert kinds[0] == "response.created"
    assert kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") == 5
    assert text == "tok " * 5
    assert usage is not None
    assert usage.output_tokens == 5
    raw = await client.responses.with_raw_response.create(
        model=MODEL, input=[{"role": "user", "content": "hi " * 30}], max_output_tokens=3
    )
    whole = raw.parse()
    assert whole.output_text == "tok " * 3
    request_id = raw.headers["x-tokenfleet-request-id"]
    completed = await latest_event(front, request_id, RequestCompleted)
    assert completed is not None
    assert completed.output_tokens == 3


async def test_embeddings_by_least_load(front: Gateway, client: openai.AsyncOpenAI) -> None:
    texts = ["the first text " * 20, "a second one " * 20, "the first text " * 20]
    answer = await client.embeddings.create(model=MODEL, input=texts)  # base64, decoded
    vectors = np.array([d.embedding for d in answer.data])
    assert vectors.shape == (3, EMBEDDING_DIMENSION)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(vectors[0], vectors[2], rtol=1e-6)
    assert not np.allclose(vectors[0], vectors[1])
    assert answer.usage.prompt_tokens == sum(count_tokens(t) for t in texts)
    floats = await client.embeddings.create(model=MODEL, input=texts[0], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, vectors[0], rtol=1e-6)
    chosen = set()
    for _ in range(2):
        raw = await client.embeddings.with_raw_response.create(model=MODEL, input="x " * 10)
        chosen.add(raw.headers["x-tokenfleet-instance"])
    assert chosen == {"i0", "i1"}  # an idle pool takes them in turn
    assert await scraped(front.url, "tokenfleet_gateway_decisions_total", policy="least_loaded")


async def test_completions_of_several_prompts(client: openai.AsyncOpenAI) -> None:
    prompts = ["once upon a time " * 10, "in a galaxy far away " * 10]
    whole = await client.completions.create(model=MODEL, prompt=prompts, max_tokens=3, n=2)
    assert sorted(c.index for c in whole.choices) == [0, 1, 2, 3]
    assert all(c.text == "tok " * 3 for c in whole.choices)
    assert whole.usage is not None
    assert whole.usage.completion_tokens == 12
    stream = await client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, stream=True)
    texts: dict[int, str] = {}
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {0: "tok " * 4, 1: "tok " * 4}


async def test_the_instance_hears_the_gateway_s_request_id() -> None:
    """As ``X-Request-Id``, which vLLM takes for its own request's id: its logs and
    traces then name the request the gateway's events name."""
    heard: list[str | None] = []

    async def answer(request: Request) -> Response:
        heard.append(request.headers.get("x-request-id"))
        return chat_answer()

    async with (
        http_server(fake_instance("/v1/chat/completions", answer)) as upstream,
        gateway(fleet_for([upstream])) as front,
        front.client() as http,
    ):
        answered = await http.post("/v1/chat/completions", json=chat("hi " * 10))
    assert heard == [answered.headers["x-tokenfleet-request-id"]]


async def test_the_model_routes_and_paths_as_vllm_serves_them(front: Gateway) -> None:
    async with front.client() as http:
        card = await http.get(f"/v1/models/{MODEL}")
        missing = await http.get("/v1/models/no-such-model")
        slashed = await http.post("/v1/chat/completions/", json=chat("hi " * 20))
        models_slashed = await http.get("/v1/models/")
        unknown = await http.post("/v1/no-such-route", json={})
    assert card.status_code == 200
    assert (card.json()["id"], card.json()["max_model_len"]) == (MODEL, 8192)
    assert missing.status_code == 404
    assert missing.json()["error"]["param"] == "model"
    assert slashed.status_code == 200
    assert slashed.json()["choices"][0]["message"]["content"] == "tok " * 4
    assert models_slashed.status_code == 200
    assert unknown.status_code == 404
    assert unknown.json()["error"]["type"] == "not_found_error"
    assert "/v1/no-such-route" in unknown.json()["error"]["message"]


async def test_tokenize_and_detokenize_reach_an_instance(front: Gateway) -> None:
    async with front.client() as http:
        tokens = await http.post("/tokenize", json={"model": MODEL, "prompt": "hello, world"})
        text = await http.post("/detokenize", json={"tokens": tokens.json()["tokens"]})
        chat_tokens = await http.post("/tokenize", json=chat("hi"))
        unknown = await http.post("/tokenize", json={"model": "nope", "prompt": "x"})
    assert tokens.status_code == 200
    assert tokens.json()["count"] == 3
    assert text.json() == {"prompt": "hello, world"}  # no model: the fleet's only one
    assert chat_tokens.json()["count"] > 2
    assert unknown.status_code == 404


async def test_a_request_naming_no_model_runs_on_the_fleet_s_only_one(front: Gateway) -> None:
    """As vLLM's server serves its one model; the schema refused it (400)."""
    unnamed = {k: v for k, v in chat("hi " * 10).items() if k != "model"}
    async with front.client() as http:
        answered = await http.post("/v1/chat/completions", json=unnamed)
        streamed = await http.post("/v1/chat/completions", json=unnamed | {"stream": True})
    assert answered.status_code == 200, answered.text
    assert answered.json()["model"] == MODEL
    assert streamed.status_code == 200
    assert streamed.text.rstrip().endswith("data: [DONE]")


async def test_null_for_stream_and_n_reads_as_unset(front: Gateway) -> None:
    """OpenAI's API and vLLM's server take both as not set; the schema refused them (400)."""
    nulls = {"stream": None, "n": None}
    async with front.client() as http:
        chat_answer = await http.post("/v1/chat/completions", json=chat("hi " * 10) | nulls)
        text_answer = await http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2} | nulls
        )
    assert chat_answer.status_code == 200, chat_answer.text
    assert len(chat_answer.json()["choices"]) == 1  # whole, one choice
    assert text_answer.status_code == 200, text_answer.text
    assert text_answer.headers["content-type"].startswith("application/json")


async def test_bad_input_is_refused_in_openai_format_and_nothing_reaches_an_instance(
    instances: list[EmulatedInstance],
) -> None:
    async with (
        gateway(fleet_for([i.url for i in instances]), max_body_bytes=64 * 1024) as front,
        front.client() as http,
    ):
        big = await http.post("/v1/chat/completions", json=chat("x" * 1_000_000))
        role = await http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
        )
        hot = await http.post("/v1/chat/completions", json=chat("hi", temperature=9))
        top_p = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "top_p": 0})
        after = await http.post("/v1/chat/completions", json=chat("still here " * 10))
    assert (big.status_code, big.json()["error"]["code"]) == (413, 413)
    assert role.status_code == 400
    assert "wizard" in role.json()["error"]["message"]
    assert (hot.status_code, hot.json()["error"]["param"]) == (400, "temperature")
    assert (top_p.status_code, top_p.json()["error"]["param"]) == (400, "top_p")
    assert after.status_code == 200
    served = [await scraped(i.url, "vllm:e2e_request_latency_seconds_count") for i in instances]
    assert sum(served) == 1


async def test_a_body_past_the_limit_sent_in_chunks_gets_413(front: Gateway) -> None:
    """No length announced: the gateway finds out while reading, and answers all the same."""

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"model": "emulated", "messages": [{"role": "user", "content": "'
        for _ in range(6):
            yield b"x" * 1024 * 1024
        yield b'"}]}'

    async with front.client() as http:
        response = await http.post("/v1/chat/completions", content=chunks())
    assert "content-length" not in response.request.headers
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("path", "body", "why"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": ""}, "empty"),
        ("/v1/completions", {"model": MODEL, "prompt": ["a", ""]}, "empty"),
        ("/v1/embeddings", {"model": MODEL, "input": []}, "empty"),
        # an id past 64 bits took the emulator down with a 500 (found by the schema test)
        ("/v1/completions", {"model": MODEL, "prompt": [5, -1]}, "out of vocabulary"),
        ("/v1/embeddings", {"model": MODEL, "input": [[1], [2, 1 << 70]]}, "out of vocabulary"),
    ],
)
async def test_a_prompt_no_engine_can_start_is_refused(
    front: Gateway, path: str, body: dict, why: str
) -> None:
    async with front.client() as http:
        refused = await http.post(path, json=body)
    assert refused.status_code == 400
    assert why in refused.json()["error"]["message"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"messages": [{"role": ["user"], "content": "hi"}]}, "messages"),
        ({"messages": [{"role": {"a": 1}, "content": "hi"}]}, "messages"),
        ({"tools": [{"type": "function", "function": "x"}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "x"}}, "tool_choice"),
        # vLLM refuses it; the emulator, whose answers stand for vLLM's, took it
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
async def test_a_malformed_chat_is_refused_in_openai_s_format(
    front: Gateway, extra: dict, param: str
) -> None:
    """An unhashable role answered a bare text 500, and a tool that was no object took
    the emulator down with a 500 where vLLM answers 400."""
    async with front.client() as http:
        refused = await http.post("/v1/chat/completions", json=chat("hi") | extra)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == param


async def test_a_failure_of_the_gateway_itself_is_answered_in_openai_s_format(
    front: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(front.app.state.gateway.decider, "choose_dcs", broken)
    async with front.client() as http:
        failed = await http.post("/v1/chat/completions", json=chat("hi"))
    assert failed.status_code == 500
    assert failed.json()["error"]["code"] == 500
    assert "log" in failed.json()["error"]["message"]


async def test_a_browser_may_call_as_it_may_call_vllm(front: Gateway) -> None:
    """A preflight was refused (405), and answers carried no CORS header."""
    origin = {"origin": "https://playground.example"}
    preflight = origin | {
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
    }
    async with front.client() as http:
        asked = await http.options("/v1/chat/completions", headers=preflight)
        answered = await http.post("/v1/chat/completions", json=chat("hi"), headers=origin)
        models = await http.get("/v1/models", headers=origin)
        plain = await http.post("/v1/chat/completions", json=chat("hi"))
    assert asked.status_code == 200
    assert "authorization" in asked.headers["access-control-allow-headers"].lower()
    assert answered.status_code == models.status_code == 200
    assert answered.headers["access-control-allow-origin"] == "*"
    assert models.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-origin" not in plain.headers


async def test_cors_can_be_turned_off(instances: list[EmulatedInstance]) -> None:
    preflight = {"origin": "https://x.example", "access-control-request-method": "POST"}
    async with (
        gateway(fleet_for([i.url for i in instances]), cors_allow_origins=[]) as front,
        front.client() as http,
    ):
        asked = await http.options("/v1/chat/completions", headers=preflight)
    assert asked.status_code == 405


async def chat_begun(
    front: Gateway, rest: bytes
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A chat request begun on a raw connection: its first headers, then ``rest``."""
    host, port = front.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer "
        + KEY.encode()
        + b"\r\ncontent-type: application/json\r\n"
        + rest
    )
    await writer.drain()
    return reader, writer


async def test_a_client_gone_during_its_upload_is_no_gateway_failure(
    front: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    """Starlette's ClientDisconnect escaped as a failure of the gateway's own."""
    _, writer = await chat_begun(front, b'content-length: 1000\r\n\r\n{"model"')
    await asyncio.sleep(0.2)
    writer.close()
    await asyncio.sleep(0.2)
    async with front.client() as http:
        after = await http.post("/v1/chat/completions", json=chat("hi"))
    assert after.status_code == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_embeddings_go_to_the_instance_with_fewer_tokens_in_flight(
    front: Gateway, client: openai.AsyncOpenAI
) -> None:
    await front.app.state.gateway.parts.state.routed(
        "i0", (), 1_000, 0.0, 50_000.0
    )  # busy with others
    for _ in range(3):
        raw = await client.embeddings.with_raw_response.create(model=MODEL, input="y " * 10)
        assert raw.headers["x-tokenfleet-instance"] == "i1"


async def test_a_client_that_waits_to_upload_an_oversized_body_hears_413_first(
    front: Gateway,
) -> None:
    """``Expect: 100-continue`` (curl sends it for large bodies): no go-ahead, no upload."""
    expecting = b"content-length: 999999999\r\nexpect: 100-continue\r\n\r\n"
    reader, writer = await chat_begun(front, expecting)
    status = await asyncio.wait_for(reader.readline(), 5)
    writer.close()
    assert status.startswith(b"HTTP/1.1 413")
