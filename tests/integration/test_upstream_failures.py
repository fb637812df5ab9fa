"""How the gateway meets an instance's failures and refusals: an engine that fails before
any token (retried elsewhere), inside its stream, or in the middle of one; one request an
engine fails, or an instance that fails every request; a refusal that blames the request
and one that blames the DC; an answer behind a proxy that compresses."""

from __future__ import annotations

import json

import openai
import pytest
from starlette.applications import Starlette
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from schemas.lifecycle import RejectReason, RequestCompleted, RequestFailed, RequestRejected
from tests.gateway_harness import (
    KEY,
    MODEL,
    WEATHER,
    Gateway,
    chat,
    chat_answer,
    dying_instance,
    emulated,
    fake_instance,
    fleet_for,
    gateway,
    http_server,
    latest_event,
    scraped,
    streaming_instance,
)


def _breaking_upstream() -> Starlette:
    chunk = {"choices": [{"index": 0, "delta": {"content": "tok "}, "finish_reason": None}]}
    return dying_instance("/v1/chat/completions", [f"data: {json.dumps(chunk)}\n\n".encode()])


async def test_an_error_mid_stream_reaches_the_client_and_the_stream_ends() -> None:
    async with (
        http_server(_breaking_upstream()) as upstream,
        gateway(fleet_for([upstream])) as front,
        openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key=KEY) as client,
    ):
        stream = await client.chat.completions.create(model=MODEL, messages=WEATHER, stream=True)
        received: list[str | None] = []

        async def read() -> None:
            async for chunk in stream:
                received.append(chunk.choices[0].delta.content)

        with pytest.raises(openai.APIError, match="failed mid-stream"):
            await read()
        assert received == ["tok "]
        async with front.client() as http:
            body = chat("x " * 20, stream=True)
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                lines = [line async for line in response.aiter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        assert '"error"' in lines[-2]


def _cut_short_upstream(tokens: int, media_type: str = "text/event-stream") -> Starlette:
    """An instance whose streams close cleanly after ``tokens`` tokens, without
    ``[DONE]``: a proxy in front of an engine that died, or a wrong URL that answers 200."""
    chunk = {"choices": [{"index": 0, "delta": {"content": "tok "}, "finish_reason": None}]}

    async def stream(_: Request) -> StreamingResponse:
        events = [f"data: {json.dumps(chunk)}\n\n".encode()] * tokens or [b"<html>oops</html>"]
        return StreamingResponse(iter(events), media_type=media_type)

    return fake_instance("/v1/chat/completions", stream)


async def test_a_stream_that_closes_after_tokens_without_its_end_fails_not_completes() -> None:
    """It reached the client as a whole answer, cut short, and counted as met."""
    async with (
        http_server(_cut_short_upstream(3)) as upstream,
        gateway(fleet_for([upstream])) as front,
        front.client() as http,
    ):
        async with http.stream(
            "POST", "/v1/chat/completions", json=chat("cut me " * 10, stream=True)
        ) as response:
            lines = [line async for line in response.aiter_lines() if line]
        failed = await latest_event(
            front, response.headers["x-tokenfleet-request-id"], RequestFailed
        )
        broken = await scraped(
            front.url, "tokenfleet_gateway_upstream_errors_total", stage="after_first_token"
        )
    assert [line for line in lines if "tok " in line] == lines[:3]
    assert "its stream ended before its end" in lines[-2]
    assert lines[-1] == "data: [DONE]"
    assert failed is not None
    assert failed.error == "i0: its stream ended before its end"
    assert broken == 1


@pytest.mark.parametrize("media_type", ["text/event-stream", "text/html"])
async def test_a_stream_that_closes_before_any_token_is_retried_elsewhere(
    media_type: str,
) -> None:
    """A 200 with no event, or a page of HTML, reached the client as given."""
    async with (
        http_server(_cut_short_upstream(0, media_type)) as empty,
        emulated(1) as [alive],
        gateway(fleet_for([empty, alive.url]), policy="round_robin") as front,
        front.client() as http,
    ):
        async with http.stream(
            "POST", "/v1/chat/completions", json=chat("retry me " * 10, stream=True)
        ) as response:
            lines = [line async for line in response.aiter_lines() if line]
        retries = await scraped(front.url, "tokenfleet_gateway_retries_total")
    assert response.headers["x-tokenfleet-instance"] == "i1"
    assert lines[-1] == "data: [DONE]"
    assert retries == 1


def _in_stream_error_upstream(code: int, tokens_first: int) -> Starlette:
    """An instance that answers 200, then reports an error inside its stream as vLLM
    does (``data: {"error": ...}`` and ``[DONE]``), after some tokens or none."""
    chunk = {"choices": [{"index": 0, "delta": {"content": "tok "}, "finish_reason": None}]}
    error = {"error": {"message": "engine trouble", "type": "Error", "code": code}}
    return streaming_instance([chunk] * tokens_first + [error])


async def test_an_engine_failure_reported_before_any_token_is_retried_elsewhere() -> None:
    async with (
        http_server(_in_stream_error_upstream(500, 0)) as failing,
        emulated(1) as [alive],
        gateway(fleet_for([failing, alive.url]), policy="round_robin") as front,
        front.client() as http,
    ):
        body = chat("retry me " * 10, stream=True)
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = [line async for line in response.aiter_lines() if line]
        assert response.headers["x-tokenfleet-instance"] == "i1"
        assert lines[-1] == "data: [DONE]"
        assert "tok" in "".join(lines)
        assert await scraped(front.url, "tokenfleet_gateway_retries_total") == 1


def _poisoned_upstream() -> Starlette:
    """An instance that answers 500 to a request naming POISON, as vLLM answers a
    request whose own handling raised (a tool parser that crashed), and serves the rest."""

    async def answer(request: Request) -> Response:
        if b"POISON" in await request.body():
            error = {"error": {"message": "tool parser crashed", "type": "InternalServerError"}}
            return JSONResponse(error, status_code=500)
        return chat_answer()

    return fake_instance("/v1/chat/completions", answer)


async def test_one_request_an_engine_fails_leaves_its_instances_serving() -> None:
    """Both instances answered the poisoned request 500 and were left out, so the next
    requests found no instance (503) until the cooldown ended."""
    async with (
        http_server(_poisoned_upstream()) as first,
        http_server(_poisoned_upstream()) as second,
        gateway(fleet_for([first, second])) as front,
        front.client() as http,
    ):
        poisoned = await http.post("/v1/chat/completions", json=chat("POISON " * 10))
        after = [
            await http.post("/v1/chat/completions", json=chat(f"hi {n} " * 10)) for n in range(4)
        ]
    assert poisoned.status_code == 502
    assert "tool parser crashed" in poisoned.json()["error"]["message"]
    assert [r.status_code for r in after] == [200] * 4


def _refusing_upstream(status: int, message: str) -> Starlette:
    async def answer(_: Request) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)

    return fake_instance("/v1/chat/completions", answer)


@pytest.mark.parametrize(
    ("status", "message"),
    [
        (500, "engine dead"),
        # started without the fleet's name (vLLM's --served-model-name): it had no load,
        # so it drew most requests, and answered each 404 while counted as serving
        (404, f"The model `{MODEL}` does not exist."),
    ],
)
async def test_an_instance_failing_every_request_is_left_out(status: int, message: str) -> None:
    async with (
        http_server(_refusing_upstream(status, message)) as failing_always,
        emulated(1) as [alive],
        gateway(
            fleet_for([failing_always, alive.url]), policy="round_robin", failure_consecutive_5xx=2
        ) as front,
        front.client() as http,
    ):
        answers = [
            await http.post("/v1/chat/completions", json=chat(f"hi {n} " * 10)) for n in range(6)
        ]
        # round robin: i0 failed the 1st and 3rd, then was left out (at once: 1 retry;
        # after 5 in a row: 3)
        assert await scraped(front.url, "tokenfleet_gateway_retries_total") == 2
    assert [a.status_code for a in answers] == [200] * 6


async def test_an_answer_is_asked_for_uncompressed() -> None:
    """aiohttp asked for gzip by default: behind a proxy that compresses, every answer
    was unreadable (502) and failed its instance."""

    async def answer(_: Request) -> Response:
        return chat_answer("word " * 300)

    compressing = GZipMiddleware(fake_instance("/v1/chat/completions", answer), minimum_size=10)
    async with (
        http_server(compressing) as upstream,
        gateway(fleet_for([upstream])) as front,
        front.client() as http,
    ):
        answered = await http.post("/v1/chat/completions", json=chat("hi " * 10))
    assert answered.status_code == 200
    assert answered.json()["choices"][0]["message"]["content"] == "word " * 300


@pytest.mark.parametrize("tokens_first", [2, 0])
async def test_an_error_inside_a_stream_fails_the_request_and_frees_its_key(
    tokens_first: int,
) -> None:
    """A 400 inside a stream is a failure, before any token too: vLLM's stream generators
    report any exception so (an engine that died among them), not the request's faults
    alone."""
    async with (
        http_server(_in_stream_error_upstream(400, tokens_first)) as upstream,
        gateway(fleet_for([upstream])) as front,
        front.client() as http,
    ):
        body, key = chat("fail me " * 10, stream=True), {"idempotency-key": "k-1"}
        for _ in range(2):  # the key is free again: no 409, no replay
            async with http.stream(
                "POST", "/v1/chat/completions", json=body, headers=key
            ) as response:
                lines = [line async for line in response.aiter_lines() if line]
            assert response.status_code == 200
            assert "engine trouble" in lines[-2]
            assert "idempotent-replayed" not in response.headers
        request_id = response.headers["x-tokenfleet-request-id"]
        failed = await latest_event(front, request_id, RequestFailed)
        assert failed is not None
        assert "engine trouble" in failed.error


async def test_a_client_s_id_that_reads_like_the_model_s_404_fails_no_instance() -> None:
    """Only vLLM's whole sentence for the model fails an instance: a stored response's
    404 quotes the client's id, which could otherwise say "the model does not exist"."""
    crafted = "Response with id 'resp_the model does not exist' not found."
    async with (
        http_server(_refusing_upstream(404, crafted)) as first,
        http_server(_refusing_upstream(404, crafted)) as second,
        gateway(fleet_for([first, second]), failure_consecutive_5xx=1) as front,
        front.client() as http,
    ):
        answers = [
            await http.post("/v1/chat/completions", json=chat(f"hi {n} " * 10)) for n in range(4)
        ]
        retries = await scraped(front.url, "tokenfleet_gateway_retries_total")
    assert [a.status_code for a in answers] == [404] * 4
    assert answers[0].json()["error"]["message"] == crafted
    assert retries == 0


@pytest.mark.parametrize(
    ("status", "blames_request"), [(400, True), (422, True), (404, True), (401, False)]
)
async def test_an_instance_s_own_refusal_passes_on_and_frees_the_key(
    status: int, blames_request: bool
) -> None:
    """An instance's refusal reaches the client as given. One that blames the request (a
    prompt past the engine's context; a 404 that is not of the model, such as a
    ``previous_response_id`` another instance stored) is reported refused as invalid, in
    no DC's table; any other (a key the instance refuses) is the DC's failure."""

    async def refuse(_: Request) -> JSONResponse:
        error = {"error": {"message": "too long for my tokenizer", "code": status}}
        return JSONResponse(error, status_code=status)

    async with (
        http_server(fake_instance("/v1/chat/completions", refuse)) as upstream,
        gateway(fleet_for([upstream])) as front,
        front.client() as http,
    ):
        key = {"idempotency-key": "k-2"}
        answers = [
            await http.post("/v1/chat/completions", json=chat("x " * 10), headers=key)
            for _ in range(2)
        ]
        request_id = answers[1].headers["x-tokenfleet-request-id"]
        ended = await latest_event(
            front, request_id, RequestRejected if blames_request else RequestFailed
        )
        bus = front.app.state.gateway.parts.bus
        completions = await bus.read_latest("tf.completions")
        last_of_requests = (await bus.read_latest("tf.requests"))[request_id].payload
        refusals = await scraped(
            front.url, "tokenfleet_gateway_upstream_errors_total", stage="refused"
        )
    assert [a.status_code for a in answers] == [status, status]  # not 409 the second time
    assert answers[1].json()["error"]["message"] == "too long for my tokenizer"
    assert answers[1].headers["x-tokenfleet-instance"] == "i0"  # as any answer says
    if blames_request:
        assert isinstance(ended, RequestRejected)
        assert (ended.reason, ended.dc) == (RejectReason.INVALID, None)
        assert ended.detail == f"instance i0 answered {status}"
        assert request_id not in completions  # no failure
        assert refusals == 2  # counted per instance: a misconfigured fleet shows there
    else:
        assert isinstance(ended, RequestFailed)
        assert ended.error == f"instance answered {status}"
        assert not isinstance(last_of_requests, RequestRejected)


SGLANG_REFUSAL = {
    "object": "error",
    "message": "Requested token count exceeds the model's maximum context length.",
    "type": "BadRequestError",
    "param": None,
    "code": 400,
}
"""SGLang's error answer (``create_error_response``): its fields at the top level."""


@pytest.mark.parametrize(
    ("answer", "message", "error_type"),
    [
        (json.dumps(SGLANG_REFUSAL), SGLANG_REFUSAL["message"], "BadRequestError"),
        ("bad request from the proxy", "bad request from the proxy", "invalid_request_error"),
        # FastAPI's own answer; a message past what events carry, whole
        ('{"detail": "Not Found"}', "Not Found", "invalid_request_error"),
        (json.dumps({"message": "m" * 1000}), "m" * 1000, "invalid_request_error"),
    ],
)
async def test_an_instance_s_refusal_in_another_format_reaches_the_client_in_openai_s(
    answer: str, message: str, error_type: str
) -> None:
    """SGLang's refusal was passed on as given: a client reading ``error.message`` found
    nothing (OpenAI's SDK reads a body without ``error`` as the error itself)."""

    async def refuse(_: Request) -> Response:
        return Response(answer, status_code=400, media_type="application/json")

    async with (
        http_server(fake_instance("/v1/chat/completions", refuse)) as upstream,
        gateway(fleet_for([upstream])) as front,
        front.client() as http,
    ):
        refused = await http.post("/v1/chat/completions", json=chat("x " * 10))
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["message"], error["type"], error["code"]) == (message, error_type, 400)


async def test_a_refused_tokenize_call_leaves_the_instances_in_service(front: Gateway) -> None:
    async with front.client() as http:
        bad = await http.post(
            "/tokenize", json={"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}
        )
        after = await http.post("/v1/chat/completions", json=chat("still fine " * 10))
    assert bad.status_code == 400
    assert after.status_code == 200


def _breaking_responses_upstream() -> Starlette:
    """A Responses API stream whose engine dies after its first delta, a keep-alive
    comment after it (no number: the error's is still the delta's next)."""
    events = [
        {"type": "response.created", "sequence_number": 0, "response": {"id": "resp_1"}},
        {"type": "response.output_text.delta", "sequence_number": 1, "item_id": "msg_1",
         "output_index": 0, "content_index": 0, "delta": "tok ", "logprobs": []},
    ]  # fmt: skip
    named = [f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events]
    return dying_instance("/v1/responses", [*named, b": keep-alive\n\n"])


async def test_a_responses_stream_that_fails_midway_ends_with_the_apis_error_event() -> None:
    """The Responses API's ``error`` event, numbered after the last relayed, and no
    ``[DONE]`` (which that API never sends): not a chat stream's error chunk."""
    async with (
        http_server(_breaking_responses_upstream()) as upstream,
        gateway(fleet_for([upstream])) as front,
        openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key=KEY) as client,
    ):
        stream = await client.responses.create(model=MODEL, input="Hello", stream=True)
        received = [event async for event in stream]
    assert [event.type for event in received] == [
        "response.created",
        "response.output_text.delta",
        "error",
    ]
    error = received[-1]
    assert error.sequence_number == 2
    assert "failed mid-stream" in error.message
    assert error.code == "upstream_error"


def _breaking_after_its_end_upstream() -> Starlette:
    """A stream whose connection breaks after its ``[DONE]``."""
    chunk = {"choices": [{"index": 0, "delta": {"content": "tok "}, "finish_reason": "stop"}]}
    return dying_instance(
        "/v1/chat/completions", [f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()]
    )


async def test_a_stream_that_breaks_after_its_end_completes() -> None:
    """It got an error event after its ``[DONE]``, and counted as failed."""
    async with (
        http_server(_breaking_after_its_end_upstream()) as upstream,
        gateway(fleet_for([upstream])) as front,
        front.client() as http,
    ):
        async with http.stream(
            "POST", "/v1/chat/completions", json=chat("whole " * 10, stream=True)
        ) as response:
            lines = [line async for line in response.aiter_lines() if line]
        completed = await latest_event(
            front, response.headers["x-tokenfleet-request-id"], RequestCompleted
        )
    assert lines[-1] == "data: [DONE]"
    assert not any('"error"' in line for line in lines)
    assert completed is not None
