"""A client's request as the gateway's policies see it: who, what, and how big.

Token counts and prefix blocks follow ``control.tokens``, the rule the emulated engines
use too, so the gateway's prefix index names the blocks the engines cache.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from control.tokens import block_hashes, chat_text, count_tokens
from schemas.base import TaskClass
from schemas.fleet import FleetConfig, ModelConfig, TenantConfig
from schemas.openai_api import ApiError, ChatRequest, CompletionRequest, parse_request

CLASS_HEADER = "x-tokenfleet-class"
"""The task class: interactive (default), long_document or batch."""
DEADLINE_HEADER = "x-tokenfleet-deadline-s"
"""Seconds from now by which the request must finish (batch)."""
RESIDENCY_HEADER = "x-tokenfleet-residency"
"""Comma-separated regions allowed to execute the request; absent: any."""
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


@dataclass(frozen=True)
class Inbound:
    request_id: str
    tenant: TenantConfig
    path: str
    body: bytes
    """Forwarded to the instance as the client sent it."""
    model: ModelConfig
    stream: bool
    task_class: TaskClass
    deadline_s: float | None
    residency: tuple[str, ...]
    input_tokens: int
    output_budget: int
    blocks: tuple[int, ...]


def authenticate(fleet: FleetConfig, authorization: str | None) -> TenantConfig:
    """The tenant owning the bearer key, or ApiError(401)."""
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() == "bearer" and key:
        for tenant in fleet.tenants:
            if key.strip() in tenant.api_keys:
                return tenant
    raise ApiError(401, "Incorrect or missing API key. Send 'Authorization: Bearer <key>'.")


def read_inbound(
    fleet: FleetConfig,
    tenant: TenantConfig,
    path: str,
    body: bytes,
    headers: Mapping[str, str],
) -> Inbound:
    """Parse and size a request; ApiError 400/403/404 says what is wrong with it."""
    request = parse_request(ChatRequest if path == CHAT_PATH else CompletionRequest, body)
    model = fleet.model(request.model)
    if model is None:
        raise ApiError(404, f"The model `{request.model}` does not exist.", param="model")
    text = _prompt_text(request)
    input_tokens = len(request.prompt) if text is None else count_tokens(text)
    budget = request.output_tokens
    if input_tokens + budget > model.context_tokens:
        raise ApiError(
            400,
            f"This model's maximum context length is {model.context_tokens} tokens; the "
            f"request has {input_tokens} prompt tokens and asks for {budget} more.",
            param="messages" if path == CHAT_PATH else "prompt",
        )
    task_class = _task_class(headers.get(CLASS_HEADER), tenant)
    return Inbound(
        request_id=f"req-{uuid.uuid4().hex}",
        tenant=tenant,
        path=path,
        body=body,
        model=model,
        stream=request.stream,
        task_class=task_class,
        deadline_s=_deadline(headers.get(DEADLINE_HEADER)),
        residency=tuple(r.strip() for r in headers.get(RESIDENCY_HEADER, "").split(",") if r),
        input_tokens=input_tokens,
        output_budget=budget,
        blocks=block_hashes(text) if text else (),
    )


def _prompt_text(request: ChatRequest | CompletionRequest) -> str | None:
    """The prompt as text; None for a completion prompt given as token ids."""
    if isinstance(request, ChatRequest):
        return chat_text(request.messages)
    prompt = request.prompt
    if isinstance(prompt, str):
        return prompt
    if prompt and isinstance(prompt[0], int):
        return None
    return str(prompt[0]) if prompt else ""


def _task_class(value: str | None, tenant: TenantConfig) -> TaskClass:
    try:
        task_class = TaskClass(value or TaskClass.INTERACTIVE)
    except ValueError:
        known = ", ".join(c.value for c in TaskClass)
        raise ApiError(
            400, f"{CLASS_HEADER} must be one of {known}, not {value!r}.", param=CLASS_HEADER
        ) from None
    if task_class not in tenant.classes:
        raise ApiError(403, f"Tenant {tenant.name!r} may not send {task_class.value} requests.")
    return task_class


def _deadline(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise ApiError(
            400, f"{DEADLINE_HEADER} must be a positive number of seconds.", param=DEADLINE_HEADER
        )
    return seconds
