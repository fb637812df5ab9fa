"""The parts of the OpenAI HTTP API that TokenFleet's servers accept and answer.

Requests are lenient about fields we do not use (clients send many), strict about the ones
we do. Errors use OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from schemas.envelope import describe

DEFAULT_COMPLETION_TOKENS = 16
"""OpenAI's default ``max_tokens`` for /v1/completions."""
DEFAULT_CHAT_TOKENS = 256
"""Used when a chat request names no limit (an emulated engine cannot see an end-of-text)."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        texts = isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str)
        if texts and len(self.prompt) != 1:
            raise ValueError("prompt: only one prompt per request is supported")
        return self

    @property
    def output_tokens(self) -> int:
        return self.max_tokens or DEFAULT_COMPLETION_TOKENS


class ChatRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @property
    def output_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_CHAT_TOKENS


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

    def headers(self) -> dict[str, str]:
        """``Retry-After`` in whole seconds (at least 1) when the error says when to retry."""
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

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


RequestT = TypeVar("RequestT", bound=_Request)


def parse_request(model: type[RequestT], body: bytes) -> RequestT:
    """The request, or ApiError(400) naming the field and the problem."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise ApiError(400, describe(exc), param=param) from None
