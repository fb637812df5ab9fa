"""Reading the server-sent events of an instance's stream: what each event is to the
gateway (output, a finish, the end, nothing), and the usage and errors it reports, for
vLLM's chat and completion chunks and the Responses API's named events; and the events
the gateway ends a stream with when its instance failed midway."""

from __future__ import annotations

import enum
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from schemas.openai_api import ApiError

_DONE_EVENT = b"data: [DONE]\n\n"


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Whole server-sent events (each ending in a blank line) from raw chunks. Lines may
    end in CRLF, as the format allows (vLLM and SGLang end them in LF): read as LF, where
    such a stream was one event at its end, which reads as a stream cut short."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        if b"\r" in buffer:  # a CR may end one chunk and its LF begin the next
            buffer = buffer.replace(b"\r\n", b"\n")
        while (end := buffer.find(b"\n\n")) >= 0:
            yield buffer[: end + 2]
            buffer = buffer[end + 2 :]
    if buffer.strip():
        yield buffer


class Piece(enum.Enum):
    """What an event of a stream is, to the gateway."""

    OTHER = enum.auto()
    """Nothing generated: a role chunk, a Responses API lifecycle event, a comment."""
    DELTA = enum.auto()
    """Generated output of any kind: text, reasoning, a part of a tool call."""
    FINISH = enum.auto()
    """A choice's finish, with no output of its own."""
    END = enum.auto()
    """The end of the stream: ``[DONE]``, an error, the Responses API's last event."""


FIRST_TOKEN = frozenset({Piece.DELTA, Piece.FINISH})
"""The pieces that count as a stream's first token."""
_DELTA_FIELDS = ("content", "reasoning_content", "reasoning", "tool_calls")
"""A chat delta's fields that carry output (vLLM's reasoning parsers fill
``reasoning_content``, newer ones ``reasoning``)."""
_RESPONSE_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed"})


@dataclass(frozen=True, slots=True)
class Seen:
    """One server-sent event, read."""

    piece: Piece
    output_tokens: int | None = None
    """The output tokens so far, where the event reports usage."""
    error: str | None = None
    sequence_number: int | None = None
    """A Responses API event's number in its stream."""
    status: int | None = None
    """An error's code, where it gives one (vLLM's engine failures are 500)."""


NOTHING = Seen(Piece.OTHER)


def read_event(event: bytes) -> Seen:
    """What one whole event (from ``sse_events``) is, and what it reports."""
    data = _sse_data(event)
    if data is None:
        return NOTHING
    if data.startswith(b"[DONE]"):
        return Seen(Piece.END)
    try:
        payload = json.loads(data)
    except ValueError:
        return NOTHING
    if not isinstance(payload, dict):
        return NOTHING
    if payload.get("error"):
        error = payload["error"]
        status = error.get("code") if isinstance(error, dict) else None
        return Seen(Piece.END, error=error_text(error), status=_int(status))
    kind = payload.get("type")
    if isinstance(kind, str):
        return _responses_event(kind, payload)
    choices = payload.get("choices")
    if not choices:  # the usage chunk (with continuous usage, others report one choice)
        return Seen(Piece.OTHER, output_tokens(payload))
    piece = Piece.OTHER
    for choice in choices if isinstance(choices, list) else ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        delta = delta if isinstance(delta, dict) else {}
        # a token that ends inside a character streams no text but its logprobs
        output = choice.get("text") or choice.get("logprobs")
        if output or any(delta.get(name) for name in _DELTA_FIELDS):
            return Seen(Piece.DELTA)
        if choice.get("finish_reason") is not None:
            piece = Piece.FINISH
    return Seen(piece)


def _responses_event(kind: str, payload: dict[str, Any]) -> Seen:
    """A Responses API event: each ``*.delta`` is output; the response's end reports usage."""
    number = payload.get("sequence_number")
    number = number if type(number) is int else None  # not a bool
    if kind.endswith(".delta"):
        return Seen(Piece.DELTA, sequence_number=number)
    if kind == "error":
        return Seen(Piece.END, error=str(payload.get("message", "error")), sequence_number=number)
    if kind in _RESPONSE_ENDS:
        response = payload.get("response")
        response = response if isinstance(response, dict) else {}
        failed = error_text(response["error"]) if response.get("error") else None
        return Seen(Piece.END, output_tokens(response), failed, number)
    return NOTHING if number is None else Seen(Piece.OTHER, sequence_number=number)


def output_tokens(answer: object) -> int | None:
    """Output tokens an answer's usage reports (chat and completions name them
    ``completion_tokens``, the Responses API ``output_tokens``)."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    if not isinstance(usage, dict):
        return None
    count = usage.get("completion_tokens", usage.get("output_tokens"))
    return int(count) if isinstance(count, int) else None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) else None


def error_text(error: object) -> str:
    """An OpenAI error object's message, or the error as text."""
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)


def _sse_data(event: bytes) -> bytes | None:
    """The ``data:`` field of a server-sent event (the Responses API puts an ``event:``
    line before it)."""
    if event.startswith(b"data:"):
        return event[5:].strip()
    start = event.find(b"\ndata:")
    return None if start < 0 else event[start + 6 :].strip()


def failure_events(message: str, last_number: int | None, responses_api: bool) -> list[bytes]:
    """The events that end a stream whose instance failed after its first token, as
    its API ends one: a chat or completion stream with an OpenAI error object and
    ``[DONE]`` (as vLLM ends a stream whose engine failed); a Responses API stream with its
    ``error`` event, numbered after ``last_number``, the highest relayed (that API sends no
    ``[DONE]``: OpenAI's SDK raises on an error object there, and hands an ``error`` event
    to the client as the API's reference defines it)."""
    error = ApiError(502, message)
    if not responses_api:
        return [f"data: {json.dumps(error.body())}\n\n".encode(), _DONE_EVENT]
    event = {
        "type": "error",
        "code": error.error_type,
        "message": message,
        "param": None,
        "sequence_number": 0 if last_number is None else last_number + 1,
    }
    return [f"event: error\ndata: {json.dumps(event)}\n\n".encode()]
