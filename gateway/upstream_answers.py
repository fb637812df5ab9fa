"""What an instance's answer says, and whom it blames: the request, the instance, or its DC.

The exchange (``gateway.exchange``) acts on the verdict: a request's fault is passed on
and reported as refused, an instance's fault sends the request to the next instance,
anything else fails the request in its DC.
"""

from __future__ import annotations

import asyncio
import enum
import json

import aiohttp

from gateway.sse import error_text
from schemas.openai_api import ApiError

UPSTREAM_ERRORS = (aiohttp.ClientError, TimeoutError)
"""What a failing instance raises: refused or reset connections, bad HTTP, timeouts."""

REQUEST_FAULTS = frozenset({400, 404, 413, 422})
"""An instance's answers that blame the request (vLLM and SGLang answer 400 for a prompt
past the context or a parameter out of range, 404 for a stored response it lacks):
refused as invalid, not the DC's failure; a 404 for the model is the instance's
(``model_not_served``). Any other 4xx (a key the instance refuses, 429) is the DC's."""
ERROR_BODY_BYTES = 4096
ERROR_READ_S = 1.0
"""How much of a failed answer is read for its message, and how long it is waited for."""
ERROR_TEXT_CHARS = 300
"""How much of that message reaches the client and the events."""


class Blame(enum.Enum):
    """Whose fault an instance's 4xx answer is."""

    REQUEST = "request"
    """Passed on (in OpenAI's format, ``in_openai_format``), reported as refused
    (``REQUEST_FAULTS``)."""
    INSTANCE = "instance"
    """Failed as a 5xx is: the request goes to the next instance."""
    DC = "dc"
    """Passed on (in OpenAI's format), reported as the request's failure in its DC."""


def blame(status: int, body: bytes, model: str) -> tuple[Blame, str]:
    """Whose fault an instance's answer of ``status`` (400 or above, below 500) is, and its
    message where the verdict needed it ("" otherwise)."""
    if status == 404:
        message = message_of(body)
        if model_not_served(message, model):
            return Blame.INSTANCE, message
    return (Blame.REQUEST if status in REQUEST_FAULTS else Blame.DC), ""


def model_not_served(message: str, model: str) -> bool:
    """Whether an instance's 404 is vLLM's for a model it does not serve under that name
    ("The model `m` does not exist.", the whole message, naming the model the gateway
    sent): the gateway checked the name against the fleet, so the instance is the fault
    (started without ``--served-model-name``). Passed on, an instance so misnamed had no
    load, drew most requests, and answered each 404. Any other 404 (a
    ``previous_response_id`` another instance stored, a route the engine lacks) is the
    request's; the whole sentence is matched, since a client's own ids come back in
    those."""
    return message == f"The model `{model}` does not exist."


async def error_of(upstream: aiohttp.ClientResponse) -> str:
    """What a failed answer says, as ``": message"`` (``message_of``); "" where it cannot
    be read. The connection is closed: an error's body is not worth keeping it for. A body
    that trickles delays the request's retry by ``ERROR_READ_S`` at most."""
    body = b""
    try:
        async with asyncio.timeout(ERROR_READ_S):
            while len(body) < ERROR_BODY_BYTES and not upstream.content.at_eof():
                body += await upstream.content.read(ERROR_BODY_BYTES - len(body))
    except UPSTREAM_ERRORS:
        pass  # what came in time
    finally:
        upstream.close()
    text = message_of(body)
    return f": {text}" if text else ""


def message_of(body: bytes) -> str:
    """An error answer's message (OpenAI's error object, vLLM's older ``ErrorResponse``,
    or its text), cut to ``ERROR_TEXT_CHARS``."""
    try:
        answer = json.loads(body)
    except ValueError:
        text = body.decode(errors="replace").strip()
    else:
        text = error_text(answer.get("error", answer) if isinstance(answer, dict) else answer)
    return text[:ERROR_TEXT_CHARS]


def in_openai_format(status: int, body: bytes) -> bytes:
    """An instance's error answer of ``status`` as OpenAI's clients read it, an ``error``
    object, as the gateway's own errors are. SGLang (and vLLM's older ``ErrorResponse``)
    put the error's fields at the top level, where a client reading ``error.message``
    found nothing; FastAPI answers ``detail``; a proxy in front of an engine may answer in
    text. An answer already in that format passes as given; the others keep their
    message (``_MESSAGE_KEYS``), whole, and their type and param."""
    try:
        answer = json.loads(body)
    except ValueError:
        answer = body.decode(errors="replace").strip()
    if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
        return body
    fields = answer if isinstance(answer, dict) else {}
    said = next((fields[key] for key in _MESSAGE_KEYS if key in fields), answer)
    message = said if isinstance(said, str) else json.dumps(said)
    error = ApiError(
        status,
        message or f"The model instance answered {status}.",
        param=_text(fields.get("param")),
        error_type=_text(fields.get("type")),
    )
    return json.dumps(error.body()).encode()


_MESSAGE_KEYS = ("message", "detail", "error")
"""Where an error answer not in OpenAI's format puts its message: SGLang's and vLLM's
older ``message``, FastAPI's ``detail``, a flat ``error``."""


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None
