"""How the gateway reads the events of a stream it relays: what is output, what ends it,
what usage it reports. Chunks as vLLM sends them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.sse import Piece, Seen, failure_events, read_event, sse_events
from schemas.openai_api import ApiError, ChatRequest, CompletionRequest, parse_request


def data(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def chat_chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return data({"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [choice]})


def named(kind: str, **fields: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()


@pytest.mark.parametrize(
    ("event", "piece"),
    [
        (chat_chunk({"role": "assistant", "content": ""}), Piece.OTHER),
        (chat_chunk({"content": "tok "}), Piece.DELTA),
        (chat_chunk({"reasoning_content": "hmm "}), Piece.DELTA),
        (chat_chunk({"reasoning": "hmm ", "content": None}), Piece.DELTA),
        (
            chat_chunk(
                {"tool_calls": [{"index": 0, "id": "t", "function": {"name": "get_weather"}}]}
            ),
            Piece.DELTA,
        ),
        (chat_chunk({}, "stop"), Piece.FINISH),
        (chat_chunk({"content": "end"}, "length"), Piece.DELTA),
        (data({"choices": [{"index": 1, "text": "tok ", "finish_reason": None}]}), Piece.DELTA),
        (data({"choices": [{"index": 1, "text": "", "finish_reason": "stop"}]}), Piece.FINISH),
        (b"data: [DONE]\n\n", Piece.END),
        (b": keep-alive\n\n", Piece.OTHER),
        (b"data: not json\n\n", Piece.OTHER),
        (named("response.created", response={"status": "in_progress"}), Piece.OTHER),
        (named("response.output_text.delta", delta="tok "), Piece.DELTA),
        (named("response.reasoning_text.delta", delta="hmm "), Piece.DELTA),
        (named("response.function_call_arguments.delta", delta="{"), Piece.DELTA),
    ],
)
def test_what_each_event_is(event: bytes, piece: Piece) -> None:
    assert read_event(event).piece is piece


def test_usage_is_read_from_chat_and_responses_events() -> None:
    usage = {"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17}
    assert read_event(data({"choices": [], "usage": usage})) == Seen(Piece.OTHER, 7)
    done = {"status": "completed", "usage": {"input_tokens": 10, "output_tokens": 5}}
    assert read_event(named("response.completed", response=done)) == Seen(Piece.END, 5)


def test_odd_or_partial_chunks_are_read_without_failing() -> None:
    partial = {"index": 0, "delta": {"content": ""}, "logprobs": {"content": [{"token": "x"}]}}
    assert read_event(data({"choices": [partial]})).piece is Piece.DELTA  # half a character
    assert read_event(data({"choices": ["x", None]})) == Seen(Piece.OTHER)
    assert read_event(data({"choices": [{"delta": "x", "finish_reason": None}]})).piece is (
        Piece.OTHER
    )
    assert read_event(data({"choices": {"0": 1}})) == Seen(Piece.OTHER)
    assert read_event(data({"type": "response.completed", "response": []})) == Seen(Piece.END)


def test_usage_on_every_chunk_counts_only_from_the_final_one() -> None:
    """With continuous usage stats and several choices, a chunk's usage is its choice's."""
    usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
    choice = {"index": 1, "delta": {"content": "tok "}, "finish_reason": None}
    assert read_event(data({"choices": [choice], "usage": usage})) == Seen(Piece.DELTA)


def test_errors_end_the_stream_with_their_message() -> None:
    error = {"error": {"message": "boom", "type": "BadRequestError", "code": 400}}
    assert read_event(data(error)) == Seen(Piece.END, error="boom", status=400)
    failed = {"status": "failed", "error": {"code": "server_error", "message": "oom"}}
    assert read_event(named("response.failed", response=failed)) == Seen(Piece.END, error="oom")


def test_a_failed_responses_stream_s_error_event_is_numbered_after_the_highest_read() -> None:
    """It took the last event's number plus one, and 0 where the last had none (a comment,
    or ``true``, a bool): it repeated ``response.created``'s 0."""
    assert read_event(named("response.created", sequence_number=0)).sequence_number == 0
    assert read_event(named("response.output_text.delta", sequence_number=4)).sequence_number == 4
    assert read_event(named("response.in_progress", sequence_number=True)).sequence_number is None
    assert read_event(b": keep-alive\n\n").sequence_number is None
    [event] = failure_events("broke", 4, responses_api=True)
    assert event.startswith(b"event: error\ndata: ")
    assert json.loads(event.split(b"data: ", 1)[1]) == {
        "type": "error",
        "code": "upstream_error",
        "message": "broke",
        "param": None,
        "sequence_number": 5,
    }
    error, done = failure_events("broke", None, responses_api=False)
    assert json.loads(error.removeprefix(b"data: "))["error"]["message"] == "broke"
    assert done == b"data: [DONE]\n\n"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 9),
        ("temperature", -0.5),
        ("top_p", 0),
        ("top_p", 1.5),
        ("presence_penalty", 3),
        ("frequency_penalty", -2.5),
        ("n", 0),
        ("top_k", -2),
        ("min_p", 1.5),
        ("repetition_penalty", 0),
    ],
)
def test_sampling_parameters_out_of_range_are_refused(field: str, value: float) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}
    with pytest.raises(ApiError) as refused:
        parse_request(ChatRequest, json.dumps(body).encode())
    assert (refused.value.status, refused.value.param) == (400, field)


def test_sampling_parameters_at_their_bounds_are_taken() -> None:
    body = {"model": "m", "prompt": "x", "temperature": 2, "top_p": 1, "top_k": -1, "min_p": 0}
    assert parse_request(CompletionRequest, json.dumps(body).encode()).temperature == 2


def test_a_role_outside_the_api_is_refused_and_every_api_role_is_taken() -> None:
    roles = ["system", "developer", "user", "assistant", "tool", "function"]
    messages = [{"role": role, "content": "x"} for role in roles]
    assert len(parse_request(ChatRequest, _chat(messages)).messages) == 6
    with pytest.raises(ApiError, match="'wizard'") as refused:
        parse_request(ChatRequest, _chat([{"role": "wizard", "content": "x"}]))
    assert refused.value.param == "messages"


def _chat(messages: list[dict[str, str]]) -> bytes:
    return json.dumps({"model": "m", "messages": messages}).encode()


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [
        ("one", ["one"]),
        (["one", "two"], ["one", "two"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_a_completion_holds_one_prompt_or_several(prompt: Any, prompts: list[Any]) -> None:
    body = json.dumps({"model": "m", "prompt": prompt}).encode()
    assert parse_request(CompletionRequest, body).prompts == prompts


async def test_events_whose_lines_end_in_crlf_are_split_as_those_ending_in_lf() -> None:
    """Such a stream came out as one event at its end: read as cut short, it failed every
    instance that sent it."""
    stream = chat_chunk({"content": "hi"}) + data({"choices": []}) + b"data: [DONE]\n\n"
    crlf = stream.replace(b"\n", b"\r\n")

    async def chunks() -> AsyncIterator[bytes]:
        for at in range(0, len(crlf), 7):  # a CR at the end of some chunks
            yield crlf[at : at + 7]

    events = [event async for event in sse_events(chunks())]
    assert [read_event(e).piece for e in events] == [Piece.DELTA, Piece.OTHER, Piece.END]
    assert b"".join(events) == stream
