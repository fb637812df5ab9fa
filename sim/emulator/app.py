"""One emulated vLLM instance as an OpenAI-compatible HTTP app.

Prompts become tokens and prefix blocks by ``control.tokens`` (the gateway's rule too);
each choice generates exactly its budget (``max_tokens``, else the defaults in
``schemas.openai_api``, shortened to the room its prompt leaves in the context), shaped
as ``sim.emulator.answers`` says (text, reasoning, tool calls). It serves vLLM's routes:
chat and completions (several prompts, ``n`` choices), the Responses API, embeddings (a
prefill of each input on the engine), ``/tokenize`` and ``/detokenize``. A client that
disconnects cancels its request and frees its blocks. Where asked to, ``/kv-events``
serves the engine's KV events, which vLLM would publish on ZMQ, to the collector.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from control.tokens import (
    chat_text,
    prompt_block_hashes,
    prompt_tokens,
    token_ids,
    token_text,
)
from schemas.openai_api import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    Prompt,
    ResponsesRequest,
    context_budgets,
    parse_request,
)
from sim.emulator import answers
from sim.emulator.answers import EMBEDDING_DIMENSION, Api, Call, ResponseStream
from sim.emulator.driver import EngineDriver
from sim.emulator.kv_feed import KvEventFeed
from sim.emulator.metrics import EngineMetrics
from sim.engine import RequestTooLong
from sim.engine import Sequence as EngineSequence
from sim.workload import TraceRequest

KV_EVENTS_PER_PAGE = 10_000

Tokens = asyncio.Queue[int | None]
"""A sequence's tokens as the driver streams them: a count per step, None at the end."""


@dataclass(frozen=True)
class Instance:
    """What every route of one emulated instance needs."""

    driver: EngineDriver
    model: str
    reasoning: bool

    def served_model(self, name: str | None) -> str:
        """The model a request names, or this one where it names none, as vLLM takes it;
        ApiError(404) for another."""
        if name is not None and name != self.model:
            raise ApiError(404, f"The model `{name}` does not exist.", param="model")
        return self.model


def create_app(
    driver: EngineDriver,
    model: str,
    metrics: EngineMetrics,
    kv_feed: KvEventFeed | None,
    reasoning: bool = False,
) -> FastAPI:
    """The instance's HTTP API; ``/kv-events`` only with a ``kv_feed``; ``reasoning``: it
    answers as a reasoning model served with a reasoning parser."""
    app = FastAPI(title=f"TokenFleet emulated vLLM ({model})")
    instance = Instance(driver, model, reasoning)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model, "object": "model", "created": 0, "owned_by": "tokenfleet"}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if kv_feed is not None:
        _serve_kv_events(app, kv_feed)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse_request(CompletionRequest, await request.body())
        prompts = [p for p in body.prompts for _ in range(body.n)]  # choice i * n + j
        call = _call(instance, Api.COMPLETION, body, body.prompts, body.n)
        return await _generate(request, instance, call, prompts)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = parse_request(ChatRequest, await request.body())
        text = chat_text(body.messages, body.tools)
        call = _call(instance, Api.CHAT, body, [text], body.n, body.called_tool)
        return await _generate(request, instance, call, [text] * body.n)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        body = parse_request(ResponsesRequest, await request.body())
        text = chat_text(body.messages(), body.tools)
        call = _call(instance, Api.RESPONSES, body, [text], 1)
        return await _generate(request, instance, call, [text])

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        body = parse_request(EmbeddingRequest, await request.body())
        return await _embed(request, instance, body)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = _json_object(await request.body())
        if "messages" in body:
            chat = {"model": model, "messages": body["messages"]}
            text = chat_text(parse_request(ChatRequest, json.dumps(chat).encode()).messages)
        else:
            text = str(body.get("prompt", ""))
        ids = token_ids(text)
        limit = driver.engine.config.max_tokens_per_sequence
        return {"count": len(ids), "max_model_len": limit, "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        ids = _json_object(await request.body()).get("tokens", [])
        try:
            return {"prompt": token_text(ids)}
        except (OverflowError, TypeError, AttributeError):
            raise ApiError(400, "tokens: a list of token ids is expected", param="tokens") from None

    return app


def _json_object(body: bytes) -> dict[str, Any]:
    """A body that must be a JSON object, or ApiError(400)."""
    try:
        value = json.loads(body or b"{}")
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ApiError(400, "The body must be a JSON object.")
    return value


def _serve_kv_events(app: FastAPI, kv_feed: KvEventFeed) -> None:
    @app.get("/kv-events")
    async def kv_events(
        after: str = "0", limit: str = str(KV_EVENTS_PER_PAGE), epoch: str | None = None
    ) -> Response:
        """The engine's KV events numbered past ``after`` (``sim/emulator/kv_feed.py``),
        encoded by ``json`` itself: FastAPI's encoder took 23 ms for 6,000 events, time the
        instances sharing this event loop would lose."""
        most = min(_count(limit, "limit", 1), KV_EVENTS_PER_PAGE)
        page = kv_feed.page(_count(after, "after", 0), most, epoch)
        return Response(json.dumps(page.body()), media_type="application/json")


def _count(value: str, name: str, least: int) -> int:
    """A whole-number query parameter, or ApiError(400) naming it."""
    try:
        number = int(value)
    except ValueError:
        number = least - 1
    if number < least:
        raise ApiError(400, f"`{name}` must be a whole number of at least {least}.", param=name)
    return number


_PROMPT_PARAM = {Api.CHAT: "messages", Api.COMPLETION: "prompt", Api.RESPONSES: "input"}


def _call(
    instance: Instance,
    api: Api,
    body: ChatRequest | CompletionRequest | ResponsesRequest,
    prompts: Sequence[Prompt],
    n: int,
    tool: str | None = None,
) -> Call:
    """``prompts``: each once, each answered ``n`` times (choice ``i * n + j``)."""
    prefix = {Api.CHAT: "chatcmpl", Api.COMPLETION: "cmpl", Api.RESPONSES: "resp"}[api]
    counts = [prompt_tokens(p) for p in prompts]
    budgets = _budgets(instance, body, counts, _PROMPT_PARAM[api])
    thinking = instance.reasoning and api is Api.CHAT  # chat's one prompt: one budget
    return Call(
        api,
        instance.served_model(body.model),
        f"{prefix}-{uuid.uuid4().hex}",
        int(time.time()),
        prompt_tokens=sum(counts),
        budgets=tuple(budget for budget in budgets for _ in range(n)),
        stream=body.stream,
        include_usage=body.include_usage,
        tool=tool,
        reasoning=answers.reasoning_tokens(budgets[0], tool is not None) if thinking else 0,
        priority=_priority(body),
    )


def _budgets(
    instance: Instance,
    body: ChatRequest | CompletionRequest | ResponsesRequest,
    counts: list[int],
    prompt_param: str,
) -> list[int]:
    """Each prompt's output budget, as vLLM sets it (``context_budgets``)."""
    limit = instance.driver.engine.config.max_tokens_per_sequence
    return context_budgets(
        counts, body.output_tokens, body.client_cap, limit, prompt_param, cap_param=body.cap_param
    )


def _priority(body: ChatRequest | CompletionRequest | ResponsesRequest) -> int:
    """vLLM's ``priority`` extension (default 0), or ApiError(400) for a non-integer."""
    value = (body.model_extra or {}).get("priority", 0)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ApiError(400, "`priority` must be an integer.", param="priority")
    return value


def _submit(
    instance: Instance,
    request_id: str,
    prompts: Sequence[Prompt],
    budgets: Sequence[int],
    priority: int = 0,
) -> list[tuple[EngineSequence, Tokens]]:
    """One engine sequence per prompt, generating its budget; ApiError(400) if one can
    never fit (none is left queued then). Empty prompts never come here: the request
    types refuse them."""
    driver = instance.driver
    submitted: list[tuple[EngineSequence, Tokens]] = []
    for n, (prompt, budget) in enumerate(zip(prompts, budgets, strict=True)):
        blocks = prompt_block_hashes(prompt)
        tokens = prompt_tokens(prompt)
        work = TraceRequest(f"{request_id}-{n}", driver.now(), tokens, budget, blocks)
        try:
            submitted.append(driver.submit(work, priority))
        except RequestTooLong as exc:
            for sequence, _ in submitted:
                driver.cancel(sequence)
            limit = driver.engine.config.max_tokens_per_sequence
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens; the request needs {exc}.",
                param="max_tokens",
            ) from None
    return submitted


async def _generate(
    request: Request, instance: Instance, call: Call, prompts: Sequence[Prompt]
) -> Response:
    submitted = _submit(instance, call.request_id, prompts, call.budgets, call.priority)
    if call.stream:
        return StreamingResponse(
            _stream(instance.driver, submitted, call), media_type="text/event-stream"
        )
    counts = await _until_done(request, instance.driver, submitted)
    if counts is None:
        return Response(status_code=499)
    return JSONResponse(answers.whole_body(call, counts))


async def _until_done(
    request: Request, driver: EngineDriver, submitted: list[tuple[EngineSequence, Tokens]]
) -> list[int] | None:
    """Each sequence's generated tokens once all are done and the API's overhead has
    passed; None if the client left first (every sequence is then cancelled)."""
    streams = [tokens for _, tokens in submitted]
    collect = asyncio.ensure_future(_drain(streams, driver.api_overhead_s()))
    gone = asyncio.ensure_future(_disconnected(request))
    done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    if collect not in done:
        collect.cancel()
        for sequence, _ in submitted:
            driver.cancel(sequence)
        return None
    gone.cancel()
    return collect.result()


async def _drain(streams: list[Tokens], overhead_s: float) -> list[int]:
    counts = []
    for tokens in streams:
        generated = 0
        while (count := await tokens.get()) is not None:
            generated += count
        counts.append(generated)
    await asyncio.sleep(overhead_s)
    return counts


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body was read, so only that can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream(
    driver: EngineDriver, submitted: list[tuple[EngineSequence, Tokens]], call: Call
) -> AsyncIterator[str]:
    responses = ResponseStream(call) if call.api is Api.RESPONSES else None
    done = [0] * len(submitted)
    started = False
    try:
        for event in responses.opening() if responses else ():
            yield event
        async for choice, count in _merged([t for _, t in submitted]):
            if not started:
                # a chat stream's roles come with its first output, not at once, as vLLM's
                # (first_iteration in vllm/entrypoints/openai/chat_completion/serving.py)
                await asyncio.sleep(driver.api_overhead_s())
                started = True
                for event in answers.opening_chunks(call):
                    yield event
            if responses is not None:
                events = responses.tokens(count)
            else:
                events = answers.token_chunks(call, choice, done[choice], count)
            done[choice] += count
            for event in events:
                yield event
        if responses is not None:
            for event in responses.closing(sum(done)):
                yield event
            return  # vLLM ends a Responses stream with its last event, no [DONE]
        if call.include_usage:
            yield answers.usage_chunk(call, sum(done))
        yield answers.DONE
    finally:
        for sequence, _ in submitted:  # a no-op once finished; frees blocks if the client left
            driver.cancel(sequence)


async def _merged(streams: list[Tokens]) -> AsyncIterator[tuple[int, int]]:
    """(choice, count) as the sequences generate, until every one has finished."""
    if len(streams) == 1:
        while (count := await streams[0].get()) is not None:
            yield 0, count
        return
    merged: asyncio.Queue[tuple[int, int | None]] = asyncio.Queue()

    async def pump(choice: int, tokens: Tokens) -> None:
        while (count := await tokens.get()) is not None:
            merged.put_nowait((choice, count))
        merged.put_nowait((choice, None))

    pumps = [asyncio.ensure_future(pump(n, tokens)) for n, tokens in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            choice, count = await merged.get()
            if count is None:
                running -= 1
            else:
                yield choice, count
    finally:
        for task in pumps:
            task.cancel()


async def _embed(request: Request, instance: Instance, body: EmbeddingRequest) -> Response:
    """Each input is prefilled on the engine (one token generated, as a pooling model's
    forward pass costs about a prefill), then answered with ``answers.embedding``."""
    model = instance.served_model(body.model)
    if body.dimensions is not None and body.dimensions != EMBEDDING_DIMENSION:
        raise ApiError(
            400,
            f"This model does not support `dimensions` other than {EMBEDDING_DIMENSION}.",
            param="dimensions",
        )
    prompts = body.prompts
    submitted = _submit(instance, f"embd-{uuid.uuid4().hex}", prompts, [1] * len(prompts))
    if await _until_done(request, instance.driver, submitted) is None:
        return Response(status_code=499)
    vectors = [answers.embedding(p) for p in prompts]
    used = sum(prompt_tokens(p) for p in prompts)
    return JSONResponse(answers.embeddings_body(model, vectors, body.encoding_format, used))
