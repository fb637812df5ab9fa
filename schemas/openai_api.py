"""The parts of the OpenAI HTTP API that TokenFleet's servers accept and answer.

Requests are lenient about fields we do not use (clients send many), strict about the ones
we do. Errors use OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal, TypeVar, cast

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from schemas.envelope import describe

DEFAULT_COMPLETION_TOKENS = 16
"""OpenAI's default ``max_tokens`` for /v1/completions."""
DEFAULT_CHAT_TOKENS = 256
"""Used when a chat request names no limit (an emulated engine cannot see an end-of-text)."""


class _ModelRequest(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    model: str | None = Field(default=None, min_length=1)
    """None: the one model served, as vLLM's server takes a request that names none."""


class _Request(_ModelRequest):
    """A generation request: streamed or whole, with OpenAI's sampling parameters.

    The bounds are the OpenAI API's; those vLLM adds (``top_k``, ``min_p``,
    ``repetition_penalty``) are vLLM's ``SamplingParams`` checks. A request outside them
    is answered 400 here instead of reaching an instance.
    """

    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1, le=128)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)

    @field_validator("stream", "n", mode="before")
    @classmethod
    def _null_as_unset(cls, value: object, info: ValidationInfo) -> object:
        """OpenAI's API and vLLM's server take ``null`` for these as not set, and clients
        that build a body from their own defaults send it."""
        return cls.model_fields[info.field_name or ""].default if value is None else value

    @field_validator("stream_options")
    @classmethod
    def _with_a_stream(
        cls, options: dict[str, Any] | None, info: ValidationInfo
    ) -> dict[str, Any] | None:
        """vLLM refuses ``stream_options`` on a request not streamed (OpenAI's reference:
        "only set this when you set stream: true")."""
        if options and not info.data.get("stream"):
            raise ValueError("stream_options can only be set when stream is true")
        return options

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


Prompt = str | list[int]
"""One prompt: text, or token ids."""


def _prompts(value: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
    """The prompts of a ``prompt`` or ``input`` field, which holds one or a list of them."""
    if isinstance(value, str):
        return [value]
    if not value or isinstance(value[0], int):
        return [cast(list[int], value)]
    return cast(list[Prompt], list(value))


def _valid_prompts(
    value: str | list[str] | list[int] | list[list[int]],
) -> str | list[str] | list[int] | list[list[int]]:
    """vLLM refuses an empty prompt (an engine cannot start a sequence of no tokens), and
    a token id outside its vocabulary: which vocabulary is the engine's, but no id is
    negative, or past a signed 64-bit integer, where every engine stores them (the
    emulator failed on one, with a 500)."""
    for prompt in _prompts(value):
        if len(prompt) == 0:
            raise ValueError("a prompt may not be empty")
        if not isinstance(prompt, str) and (min(prompt) < 0 or max(prompt) > MAX_ANY_TOKEN_ID):
            raise ValueError(f"a token id is out of vocabulary: {min(prompt)} to {max(prompt)}")
    return value


MAX_ANY_TOKEN_ID = (1 << 63) - 1


Prompts = Annotated[str | list[str] | list[int] | list[list[int]], AfterValidator(_valid_prompts)]
"""A ``prompt`` or ``input`` field: one prompt or a list of them, none empty."""


class CompletionRequest(_Request):
    prompt: Prompts
    max_tokens: int | None = Field(default=None, ge=1)

    @property
    def prompts(self) -> list[Prompt]:
        """Each prompt is run ``n`` times; choice ``i * n + j`` is prompt i's j-th."""
        return _prompts(self.prompt)

    @property
    def client_cap(self) -> int | None:
        """The cap on each choice's output the client set, if it set one."""
        return self.max_tokens

    cap_param: ClassVar[str] = "max_tokens"
    """The field that sets ``client_cap``, for an error that names it."""

    @property
    def output_tokens(self) -> int:
        """The budget of each choice."""
        return self.client_cap or DEFAULT_COMPLETION_TOKENS


MESSAGE_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


TOOL_CHOICES = frozenset({"none", "auto", "required"})
TOOL_SHAPE = "{'type': 'function', 'function': {'name': ...}}"


def _named(function: object) -> bool:
    return isinstance(function, dict) and isinstance(function.get("name"), str)


class ChatRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _known_roles(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for n, message in enumerate(messages):
            role = message.get("role")
            if not isinstance(role, str) or role not in MESSAGE_ROLES:
                known = ", ".join(sorted(MESSAGE_ROLES))
                raise ValueError(f"message {n} has role {role!r}; the roles are {known}")
        return messages

    @field_validator("tools")
    @classmethod
    def _functions(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        """Each tool a function with a name, as vLLM's ``ChatCompletionToolsParam`` reads
        it (400 otherwise)."""
        for n, tool in enumerate(tools or ()):
            if tool.get("type", "function") != "function" or not _named(tool.get("function")):
                raise ValueError(f"tool {n} is not a function with a name: {TOOL_SHAPE}")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice(cls, choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        """``none``, ``auto``, ``required``, or a named function, as vLLM reads it."""
        if isinstance(choice, str) and choice not in TOOL_CHOICES:
            known = ", ".join(sorted(TOOL_CHOICES))
            raise ValueError(f"tool_choice is one of {known} or a named function, not {choice!r}")
        if isinstance(choice, dict) and not _named(choice.get("function")):
            raise ValueError(f"tool_choice names no function: {TOOL_SHAPE}")
        return choice

    @property
    def client_cap(self) -> int | None:
        """The cap on each choice's output the client set, if it set one."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def cap_param(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    @property
    def output_tokens(self) -> int:
        """The budget of each choice."""
        return self.client_cap or DEFAULT_CHAT_TOKENS

    @property
    def called_tool(self) -> str | None:
        """The function an answer calls when the request forces or allows one: the one
        ``tool_choice`` names, else the first tool (None without tools or with
        ``tool_choice: "none"``)."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, dict):
            return str(self.tool_choice["function"]["name"]) or None
        return str(self.tools[0]["function"]["name"]) or None


class ResponsesRequest(_Request):
    """The Responses API (``/v1/responses``): ``input`` text or items, ``instructions``."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages: instructions as a system message, each
        input message as itself, a tool result as a tool message; other items (earlier
        reasoning, function calls) add no text of their own."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for item in self.input:
            kind = item.get("type", "message")
            if kind == "message":
                messages.append({"role": item.get("role", "user"), "content": item.get("content")})
            elif kind == "function_call_output":
                messages.append({"role": "tool", "content": str(item.get("output", ""))})
        return messages

    @property
    def client_cap(self) -> int | None:
        """The cap on the output the client set, if it set one."""
        return self.max_output_tokens

    cap_param: ClassVar[str] = "max_output_tokens"

    @property
    def output_tokens(self) -> int:
        return self.client_cap or DEFAULT_CHAT_TOKENS


class EmbeddingRequest(_ModelRequest):
    input: Prompts
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)

    @property
    def prompts(self) -> list[Prompt]:
        return _prompts(self.input)


class UtilityRequest(_ModelRequest):
    """A request the gateway passes to an instance of its model as sent (``/tokenize``,
    ``/detokenize``): only the model is read."""


REQUEST_ID_HEADER = "x-tokenfleet-request-id"
"""The gateway's id of a request, on every answer to it: the id its events carry."""


class ApiError(Exception):
    """An error to answer in OpenAI's format."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        error_type: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type or _TYPES.get(status, "api_error")
        self.retry_after_s = retry_after_s
        self.request_id: str | None = None
        """The gateway's id of the request it answers, once it has one."""

    def headers(self) -> dict[str, str]:
        """``Retry-After`` in whole seconds (at least 1) when the error says when to retry;
        the request's id where it has one, as a served answer carries it."""
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        if self.request_id is not None:
            headers[REQUEST_ID_HEADER] = self.request_id
        return headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.status,
            }
        }


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable",
}


def context_budgets(
    prompts: Sequence[int],
    asked: int,
    cap: int | None,
    context: int,
    prompt_param: str,
    *,
    counted: bool = True,
    cap_param: str = "max_tokens",
) -> list[int]:
    """Each prompt's output budget as vLLM 0.34 sets it: the ``asked`` one, shortened to
    the room its prompt leaves in the ``context`` (``get_max_tokens``, in
    vllm/entrypoints/serve/utils/api_utils.py). ApiError(400) where vLLM refuses: a
    budget the client capped (``cap``) beyond the context (vllm/renderers/params.py), a
    prompt that leaves no room for the one token a generation needs, or an input beyond
    the context where nothing is generated (``asked`` 0: an embedding;
    ``_validate_prompt_len`` in vllm/v1/engine/input_processor.py). Prompts whose
    lengths are estimates (``counted`` False) are not refused for them: the engine,
    which counts, judges them; one estimated to fill the context keeps the budget asked
    (at most the context), since the room the engine finds is unknown, and counting it
    whole errs toward a load that is there."""
    if cap is not None and cap > context:
        raise ApiError(
            400,
            f"The output budget ({cap} tokens) cannot be greater than this model's maximum "
            f"context length, {context} tokens.",
            param=cap_param,
        )
    longest = max(prompts)
    if counted and longest + (1 if asked else 0) > context:
        raise ApiError(
            400,
            f"This model's maximum context length is {context} tokens; the request has "
            f"{longest} prompt tokens, which leave no room for output.",
            param=prompt_param,
        )
    return [min(asked, context - p if p < context else context) for p in prompts]


RequestT = TypeVar("RequestT", bound=BaseModel)


def parse_request(model: type[RequestT], body: bytes) -> RequestT:
    """The request, or ApiError(400) naming the field and the problem."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise ApiError(400, describe(exc), param=param) from None
