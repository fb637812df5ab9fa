"""``tokenfleet replay``'s clients: they give up and come back as the simulator's do."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from schemas.base import TaskClass
from sim.clients import RETRY_SUFFIX, ClientModel
from sim.replay import replay
from sim.workload import TraceRequest
from tests.gateway_harness import http_server


def endpoint(first_answer: Response | None, first_token_after_s: float = 0.0) -> Starlette:
    """Answers its first call with ``first_answer`` (None: like the rest), and every other
    with three streamed tokens, the first after ``first_token_after_s``; records the
    class header of each call."""
    calls: list[str] = []

    async def completions(request: Request) -> Response:
        calls.append(request.headers.get("x-tokenfleet-class", ""))
        if len(calls) == 1 and first_answer is not None:
            return first_answer

        async def tokens() -> AsyncIterator[bytes]:
            await asyncio.sleep(first_token_after_s)
            for _ in range(3):
                yield f"data: {json.dumps({'choices': [{'text': 'tok '}]})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        headers = {"x-tokenfleet-request-id": f"req-{len(calls)}"}  # as the gateway sends
        return StreamingResponse(tokens(), media_type="text/event-stream", headers=headers)

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    app.state.calls = calls
    return app


async def test_a_refused_client_comes_back_after_retry_after() -> None:
    refusal = JSONResponse(
        {"error": {"message": "busy"}},
        429,
        headers={"retry-after": "1", "x-tokenfleet-request-id": "req-1"},
    )
    app = endpoint(refusal)
    chat = TraceRequest("c", 0.0, 100, 3, ())
    async with http_server(app) as url:
        records = await replay([chat], url, "m", clients=ClientModel(retry_share=1.0))
    assert [(r.request_id, r.outcome, r.status) for r in records] == [
        ("c", "rejected", 429),
        ("c" + RETRY_SUFFIX, "completed", 200),
    ]
    assert records[0].retry_after_s == 1.0
    assert records[1].output_tokens == 3
    assert [r.gateway_request_id for r in records] == ["req-1", "req-2"]  # joins the events
    assert app.state.calls == ["interactive", "interactive"]


async def test_a_client_closes_a_stream_whose_first_token_is_later_than_its_patience() -> None:
    app = endpoint(None, first_token_after_s=2.0)
    document = TraceRequest("d", 0.0, 100, 3, (), TaskClass.LONG_DOCUMENT)
    clients = ClientModel(long_document_patience_s=0.3, retry_share=0.0)
    async with http_server(app) as url:
        [record] = await replay([document], url, "m", clients=clients)
    assert (record.outcome, record.ttft_s, record.task_class) == (
        "cancelled",
        None,
        "long_document",
    )
    assert record.e2e_s < 1.5
    async with http_server(endpoint(None, first_token_after_s=0.5)) as url:
        [patient] = await replay([document], url, "m")  # no client model: it waits
    assert patient.outcome == "completed"


async def test_a_stream_that_fails_midway_or_drops_is_recorded_failed_and_the_replay_goes_on() -> (
    None
):
    calls = 0

    async def completions(_: Request) -> Response:
        nonlocal calls
        calls += 1
        call = calls

        async def tokens() -> AsyncIterator[bytes]:
            yield f"data: {json.dumps({'choices': [{'text': 'tok '}]})}\n\n".encode()
            if call == 1:  # the instance failed: the gateway's error event, then [DONE]
                error = {"error": {"message": "instance failed", "code": 502}}
                yield f"data: {json.dumps(error)}\n\n".encode()
            if call == 2:  # the server dies mid-stream: the connection drops
                raise RuntimeError("gone")
            yield b"data: [DONE]\n\n"

        return StreamingResponse(tokens(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    chats = [TraceRequest(f"c{n}", n * 0.2, 100, 3, ()) for n in range(3)]
    async with http_server(app) as url:
        records = await replay(chats, url, "m")
    assert [(r.request_id, r.status, r.outcome) for r in records] == [
        ("c0", 200, "failed"),
        ("c1", 200, "failed"),
        ("c2", 200, "completed"),
    ]
    assert [r.output_tokens for r in records] == [1, 1, 1]


def _chunks(*events: str) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        for event in events:
            yield f"data: {event}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


async def test_an_answer_it_cannot_read_fails_that_request_with_the_reason_and_no_other() -> None:
    token = json.dumps({"choices": [{"text": "tok "}]})
    answers = iter(
        [
            _chunks(token, json.dumps({"choices": [{"index": 0}]})),  # a choice without text
            _chunks("{not json"),
            _chunks(token, json.dumps({"choices": []})),  # the usage chunk: no text, readable
        ]
    )

    async def completions(_: Request) -> Response:
        return next(answers)

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    chats = [TraceRequest(f"c{n}", n * 0.1, 100, 3, ()) for n in range(3)]
    async with http_server(app) as url:
        records = await replay(chats, url, "m")
    assert [r.outcome for r in records] == ["failed", "failed", "completed"]
    assert "without a choice's text" in (records[0].error or "")
    assert "not JSON" in (records[1].error or "")
    assert records[2].error is None


async def test_a_prompt_past_any_context_is_refused_before_anything_is_sent() -> None:
    """A row of a billion tokens held the replay building a prompt of gigabytes."""
    app = endpoint(None)
    huge = [TraceRequest("ok", 0.0, 100, 3, ()), TraceRequest("huge", 0.1, 10**9, 3, ())]
    async with http_server(app) as url:
        with pytest.raises(ValueError, match="request huge: a prompt of 1,000,000,000 tokens"):
            await replay(huge, url, "m")
    assert app.state.calls == []


async def test_an_error_answer_is_recorded_with_its_message() -> None:
    """Against a fleet of another model, every request failed "with HTTP 404", and nothing
    said which model was asked for."""
    missing = {"error": {"message": "The model `m` does not exist.", "type": "NotFoundError"}}
    app = endpoint(JSONResponse(missing, status_code=404))
    chats = [TraceRequest(f"c{n}", n * 0.1, 100, 3, ()) for n in range(2)]
    async with http_server(app) as url:
        records = await replay(chats, url, "m")
    assert [r.outcome for r in records] == ["failed", "completed"]
    assert records[0].error == "HTTP 404: The model `m` does not exist."


async def test_a_retry_after_given_as_an_http_date_is_read_as_the_seconds_until_then() -> None:
    from datetime import UTC, datetime, timedelta
    from email.utils import format_datetime

    later = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
    refusals = [
        JSONResponse({"error": {"message": "busy"}}, 429, headers={"retry-after": later}),
        JSONResponse({"error": {"message": "busy"}}, 429, headers={"retry-after": "soon"}),
    ]

    async def completions(_: Request) -> Response:
        return refusals.pop(0)

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    chats = [TraceRequest(f"c{n}", n * 0.1, 100, 3, ()) for n in range(2)]
    async with http_server(app) as url:
        dated, unreadable = await replay(chats, url, "m", speedup=2.0)
    assert dated.outcome == "rejected"
    assert 2 * 28 < (dated.retry_after_s or 0) <= 2 * 30  # in the workload's seconds
    assert (unreadable.outcome, unreadable.retry_after_s) == ("rejected", None)


async def test_ctrl_c_writes_the_requests_that_ended_and_exits_130(tmp_path: Path) -> None:
    calls = 0

    async def completions(_: Request) -> Response:
        nonlocal calls
        calls += 1
        if calls == 1:
            return _chunks(json.dumps({"choices": [{"text": "tok "}]}))

        async def never() -> AsyncIterator[bytes]:
            await asyncio.Event().wait()
            yield b""

        return StreamingResponse(never(), media_type="text/event-stream")

    trace, out = tmp_path / "t.jsonl", tmp_path / "records.json"
    row = '{{"timestamp": {}, "input_length": 100, "output_length": 3, "hash_ids": [1]}}\n'
    trace.write_text(row.format(0) + row.format(100))
    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    async with http_server(app) as url:
        argv = ["replay", "--trace", str(trace), "--target", url, "--json", str(out)]
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tokenfleet.cli",
            *argv,
            stderr=asyncio.subprocess.PIPE,
            cwd=Path(__file__).parents[2],  # this checkout's tokenfleet
        )
        for _ in range(600):  # the CLI starts, sends the first request, then the second
            if calls == 2:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        process.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 130
    assert b"Traceback" not in err
    assert [r["outcome"] for r in json.loads(out.read_text())] == ["completed"]
