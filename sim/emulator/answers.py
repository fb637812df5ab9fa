"""What an emulated vLLM server says, in vLLM's shapes: chat and completion chunks and
bodies, Responses API events, embeddings.

Every output token is the 4-byte text ``"tok "``. A choice's tokens are, in order:

- **reasoning**, on an instance started as a reasoning model: the first half of the
  budget (rounded up), in ``reasoning_content`` as vLLM's reasoning parsers put it;
- then either **a tool call**, when the request offers tools and does not say
  ``tool_choice: "none"`` (the function ``tool_choice`` names, else the first tool): its
  arguments are the JSON ``{"text": "tok tok ..."}``, streamed a token at a time, and the
  choice finishes with ``tool_calls``;
- or **content**, and the choice finishes with ``length`` (the emulator always spends
  the whole budget).

Completions have no reasoning or tools: all their tokens are text.
"""

from __future__ import annotations

import base64
import hashlib
import json
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

TOKEN_TEXT = "tok "
EMBEDDING_DIMENSION = 64
"""Length of every embedding an emulated instance returns."""


class Api(Enum):
    CHAT = "chat"
    COMPLETION = "completion"
    RESPONSES = "responses"


@dataclass(frozen=True)
class Call:
    """One generation request: what it asks, and how its answer is shaped."""

    api: Api
    model: str
    request_id: str
    created: int
    prompt_tokens: int
    """All the choices' prompts together."""
    budgets: tuple[int, ...]
    """Tokens each choice generates: the asked budget, shortened where its prompt leaves
    less room in the context."""
    stream: bool
    include_usage: bool
    tool: str | None = None
    reasoning: int = 0
    """Leading tokens of each choice that are reasoning."""
    priority: int = 0
    """vLLM's request ``priority`` (lower first), under ``--scheduling-policy priority``."""
    tool_call_id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    @property
    def choices(self) -> int:
        return len(self.budgets)

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.tool else "length"


def reasoning_tokens(budget: int, calls_tool: bool = False) -> int:
    """The reasoning a reasoning model's choice does before it answers (a tool call keeps
    at least one token, so that it is made)."""
    thinking = (budget + 1) // 2
    return min(thinking, budget - 1) if calls_tool else thinking


# --- chat and completions, streamed --------------------------------------------------


def opening_chunks(call: Call) -> list[str]:
    """What a stream sends with its first output, before that output's tokens: a chat
    stream's role, per choice."""
    if call.api is not Api.CHAT:
        return []
    return [
        event(_chunk(call, i, {"role": "assistant", "content": ""}, None))
        for i in range(call.choices)
    ]


def token_chunks(call: Call, choice: int, done: int, count: int) -> list[str]:
    """The chunks of a choice's ``count`` new tokens, ``done`` generated before them; the
    last token's chunk carries the finish."""
    budget = call.budgets[choice]
    if call.api is Api.COMPLETION:
        finish = call.finish_reason if done + count >= budget else None
        choice_body = {"index": choice, "text": TOKEN_TEXT * count, "logprobs": None}
        return [event(_envelope(call, {**choice_body, "finish_reason": finish}))]
    chunks = []
    for kind, start, length in _segments(call, done, count):
        finish = call.finish_reason if start + length >= budget else None
        delta = _delta(call, kind, start, length, budget)
        chunks.append(event(_chunk(call, choice, delta, finish)))
    return chunks


def usage_chunk(call: Call, generated: int) -> str:
    return event({**_envelope(call, None), "choices": [], "usage": usage(call, generated)})


DONE = "data: [DONE]\n\n"


def event(payload: dict[str, Any], name: str | None = None) -> str:
    """A server-sent event; the Responses API names each (``event:``) as vLLM does."""
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {json.dumps(payload)}\n\n"


def _segments(call: Call, done: int, count: int) -> list[tuple[str, int, int]]:
    """The new tokens split where reasoning ends: (kind, first position, length)."""
    answer = "tool" if call.tool else "content"
    if done >= call.reasoning:
        return [(answer, done, count)]
    thinking = min(count, call.reasoning - done)
    segments = [("reasoning", done, thinking)]
    if count > thinking:
        segments.append((answer, done + thinking, count - thinking))
    return segments


def _delta(call: Call, kind: str, start: int, length: int, budget: int) -> dict[str, Any]:
    if kind == "reasoning":
        return {"reasoning_content": TOKEN_TEXT * length}
    if kind == "content":
        return {"content": TOKEN_TEXT * length}
    arguments = _arguments_part(call, start, length, budget)
    if start > call.reasoning:
        return {"tool_calls": [{"index": 0, "function": {"arguments": arguments}}]}
    function = {"name": call.tool, "arguments": arguments}
    return {"tool_calls": [{"index": 0, "id": call.tool_call_id, "type": "function",
                            "function": function}]}  # fmt: skip


def _arguments_part(call: Call, start: int, length: int, budget: int) -> str:
    """Positions ``start``.. of the arguments ``{"text": "tok tok ..."}``, one ``tok`` a
    token, the opening with the first and the closing with the last."""
    opening = '{"text": "' if start == call.reasoning else ""
    closing = '"}' if start + length >= budget else ""
    return opening + TOKEN_TEXT * length + closing


def _chunk(call: Call, choice: int, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
    body = {"index": choice, "delta": delta, "logprobs": None, "finish_reason": finish}
    return _envelope(call, body)


def _envelope(call: Call, choice: dict[str, Any] | None) -> dict[str, Any]:
    kinds = {Api.CHAT: "chat.completion.chunk", Api.COMPLETION: "text_completion"}
    return {
        "id": call.request_id,
        "object": kinds[call.api],
        "created": call.created,
        "model": call.model,
        "choices": [choice] if choice is not None else [],
    }


# --- chat and completions, whole -----------------------------------------------------


def whole_body(call: Call, generated: list[int]) -> dict[str, Any]:
    """The answer of a request not streamed; ``generated``: tokens of each choice."""
    if call.api is Api.RESPONSES:
        return _response(call, sum(generated), "completed")
    kind = "chat.completion" if call.api is Api.CHAT else "text_completion"
    choices = [_whole_choice(call, i, count) for i, count in enumerate(generated)]
    return {**_envelope(call, None), "object": kind, "choices": choices,
            "usage": usage(call, sum(generated))}  # fmt: skip


def _whole_choice(call: Call, index: int, generated: int) -> dict[str, Any]:
    if call.api is Api.COMPLETION:
        return {"index": index, "text": TOKEN_TEXT * generated, "logprobs": None,
                "finish_reason": call.finish_reason}  # fmt: skip
    thought = min(generated, call.reasoning)
    answer = TOKEN_TEXT * (generated - thought)
    message: dict[str, Any] = {"role": "assistant", "content": None if call.tool else answer}
    if call.reasoning:
        message["reasoning_content"] = TOKEN_TEXT * thought
    message["tool_calls"] = (
        [{"id": call.tool_call_id, "type": "function",
          "function": {"name": call.tool, "arguments": '{"text": "' + answer + '"}'}}]
        if call.tool else []
    )  # fmt: skip
    return {"index": index, "message": message, "logprobs": None,
            "finish_reason": call.finish_reason}  # fmt: skip


def usage(call: Call, generated: int) -> dict[str, int]:
    return {
        "prompt_tokens": call.prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": call.prompt_tokens + generated,
    }


# --- the Responses API ---------------------------------------------------------------


@dataclass
class ResponseStream:
    """The events of a streamed Responses API answer, numbered in order, for a text
    answer (one message item with one ``output_text`` part)."""

    call: Call
    numbered: int = 0

    @property
    def item_id(self) -> str:
        return f"msg_{self.call.request_id}"

    def opening(self) -> list[str]:
        item = {"id": self.item_id, "type": "message", "role": "assistant",
                "status": "in_progress", "content": []}  # fmt: skip
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self._event("response.created", response=_response(self.call, 0, "in_progress")),
            self._event("response.in_progress", response=_response(self.call, 0, "in_progress")),
            self._event("response.output_item.added", output_index=0, item=item),
            self._event("response.content_part.added", **self._at(), part=part),
        ]

    def tokens(self, count: int) -> list[str]:
        return [self._event("response.output_text.delta", **self._at(),
                            delta=TOKEN_TEXT * count, logprobs=[])]  # fmt: skip

    def closing(self, generated: int) -> list[str]:
        text = TOKEN_TEXT * generated
        part = {"type": "output_text", "text": text, "annotations": []}
        done = _response(self.call, generated, "completed")
        return [
            self._event("response.output_text.done", **self._at(), text=text, logprobs=[]),
            self._event("response.content_part.done", **self._at(), part=part),
            self._event("response.output_item.done", output_index=0, item=done["output"][0]),
            self._event("response.completed", response=done),
        ]

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    def _event(self, kind: str, **fields: Any) -> str:
        self.numbered += 1
        return event({"type": kind, "sequence_number": self.numbered - 1, **fields}, kind)


def _response(call: Call, generated: int, status: str) -> dict[str, Any]:
    output = []
    if status == "completed":
        part = {"type": "output_text", "text": TOKEN_TEXT * generated, "annotations": []}
        output.append({"id": f"msg_{call.request_id}", "type": "message", "role": "assistant",
                       "status": "completed", "content": [part]})  # fmt: skip
    return {
        "id": call.request_id,
        "object": "response",
        "created_at": call.created,
        "model": call.model,
        "status": status,
        "output": output,
        "usage": {
            "input_tokens": call.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": generated,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": call.prompt_tokens + generated,
        },
    }


# --- embeddings ----------------------------------------------------------------------


def embedding(prompt: str | list[int]) -> np.ndarray:
    """A unit vector that depends only on the prompt (equal prompts, equal vectors)."""
    key = prompt.encode() if isinstance(prompt, str) else np.asarray(prompt, "<i8").tobytes()
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest())
    vector = np.random.default_rng(seed).standard_normal(EMBEDDING_DIMENSION)
    return vector / np.linalg.norm(vector)


def embeddings_body(
    model: str, vectors: list[np.ndarray], encoding: str, prompt_tokens: int
) -> dict[str, Any]:
    """vLLM's answer to ``/v1/embeddings``; ``base64`` is little-endian float32, as the
    openai client decodes it."""
    data = [
        {"object": "embedding", "index": n, "embedding": _encoded(vector, encoding)}
        for n, vector in enumerate(vectors)
    ]
    return {
        "id": f"embd-{uuid.uuid4().hex}",
        "object": "list",
        "created": 0,
        "model": model,
        "data": data,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 0,
            "total_tokens": prompt_tokens,
        },
    }


def _encoded(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return [float(v) for v in vector]
