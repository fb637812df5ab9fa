"""A client's request as the gateway's policies see it: who, what, and how big.

Token counts and prefix blocks follow ``control.tokens``, the rule the emulated engines
use too, so the gateway's prefix index names the blocks the engines cache.
"""

from __future__ import annotations

import hashlib
import json
import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from control.admission.request import identify
from control.tokens import chat_text, count_tokens, prompt_block_hashes, prompt_tokens
from schemas.base import TaskClass
from schemas.fleet import FleetConfig, ModelConfig, TenantConfig
from schemas.openai_api import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    ResponsesRequest,
    context_budgets,
    parse_request,
)

CLASS_HEADER = "x-tokenfleet-class"
"""The task class: interactive (default), long_document or batch."""
DEADLINE_HEADER = "x-tokenfleet-deadline-s"
"""Seconds from now by which the request must finish (batch)."""
RESIDENCY_HEADER = "x-tokenfleet-residency"
"""Comma-separated regions allowed to execute the request; absent: any."""
IDEMPOTENCY_HEADER = "idempotency-key"
"""A retried request with the same key (per tenant, path and body) gets the first one's
answer."""
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
RESPONSES_PATH = "/v1/responses"
EMBEDDINGS_PATH = "/v1/embeddings"
PROXIED_PATHS = (CHAT_PATH, COMPLETIONS_PATH, RESPONSES_PATH, EMBEDDINGS_PATH)
"""Every path whose requests are admitted, routed, accounted and reported."""

ProxiedRequest = ChatRequest | CompletionRequest | ResponsesRequest | EmbeddingRequest
_REQUEST_TYPES: dict[str, type[ProxiedRequest]] = {
    CHAT_PATH: ChatRequest,
    COMPLETIONS_PATH: CompletionRequest,
    RESPONSES_PATH: ResponsesRequest,
    EMBEDDINGS_PATH: EmbeddingRequest,
}
_PROMPT_PARAM = {
    CHAT_PATH: "messages",
    COMPLETIONS_PATH: "prompt",
    RESPONSES_PATH: "input",
    EMBEDDINGS_PATH: "input",
}


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
    """Tokens the request may generate, all its choices together: what the gateway counts
    in flight (the client's cap, else the API's default, each prompt's shortened to the
    room it leaves in the context, as vLLM shortens it)."""
    blocks: tuple[int, ...]
    """The first prompt's prefix blocks (a request with several prompts is routed on its
    first)."""
    client_cap: int | None = None
    """The cap the client set, all its choices together, shortened to the context as
    ``output_budget`` is; None where it set none (a router is told only this of the
    request's length)."""
    by_load: bool = False
    """Routed to the least loaded instance: an embedding has no prefix cache to reuse
    and generates nothing, so the routing policy's model of it does not apply."""


@dataclass(frozen=True)
class _Size:
    """What a request asks of an instance."""

    first_prompt: str | Sequence[int]
    """The first prompt, text or token ids, for its prefix blocks."""
    input_tokens: int
    prompts: tuple[int, ...]
    """Each prompt's tokens."""
    choice_budget: int
    """Tokens each choice may generate, as asked."""
    choices: int
    """All the prompts' choices together (each prompt has as many)."""
    client_cap: int | None = None
    """The cap on each choice the client set, if it set one."""
    counted: bool = False
    """Whether ``prompts`` are the engine's counts (token ids sent), not estimates."""
    cap_param: str = "max_tokens"
    """The field that set ``client_cap``."""


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
    """Parse and size a request to one of ``PROXIED_PATHS``; ApiError 400/403/404 says
    what is wrong with it."""
    request = parse_request(_REQUEST_TYPES[path], body)
    model = fleet.model(request.model or only_model(fleet))
    if model is None:
        raise ApiError(404, f"The model `{request.model}` does not exist.", param="model")
    size = _size(request)
    deadline = _deadline(headers.get(DEADLINE_HEADER))
    output_budget = _output_budget(
        size, model.context_tokens, _PROMPT_PARAM[path], _shortens(fleet, model.name)
    )
    return Inbound(
        request_id=f"req-{uuid.uuid4().hex}",  # shown to clients: unguessable
        tenant=tenant,
        path=path,
        body=body,
        model=model,
        stream=not isinstance(request, EmbeddingRequest) and request.stream,
        task_class=_task_class(headers.get(CLASS_HEADER), tenant, size.input_tokens, deadline),
        deadline_s=deadline,
        residency=residency_of(headers),
        input_tokens=size.input_tokens,
        output_budget=output_budget,
        client_cap=(
            None if size.client_cap is None else min(size.client_cap * size.choices, output_budget)
        ),
        blocks=prompt_block_hashes(size.first_prompt),
        by_load=isinstance(request, EmbeddingRequest),
    )


def model_named(fleet: FleetConfig, body: bytes) -> str | None:
    """The fleet's model a request's body names, read without the rest of it: what a
    request refused as invalid is counted under. A name outside the fleet is not (a
    client could add series without end)."""
    try:
        named = json.loads(body).get("model")
    except (ValueError, AttributeError, RecursionError):  # not JSON, not an object, too deep
        return None
    return named if isinstance(named, str) and fleet.model(named) is not None else None


def only_model(fleet: FleetConfig) -> str:
    """The model of a request that names none: the fleet's one model, as vLLM's server
    serves its one; ApiError(400) where the fleet serves several."""
    if len(fleet.models) == 1:
        return fleet.models[0].name
    names = ", ".join(f"`{m.name}`" for m in fleet.models)
    raise ApiError(400, f"Name the model: this fleet serves {names}.", param="model")


def _size(request: ProxiedRequest) -> _Size:
    if isinstance(request, ChatRequest | ResponsesRequest):
        messages = request.messages if isinstance(request, ChatRequest) else request.messages()
        text = chat_text(messages, request.tools)
        tokens = count_tokens(text)
        return _Size(
            text,
            tokens,
            (tokens,),
            request.output_tokens,
            request.n,
            request.client_cap,
            cap_param=request.cap_param,
        )
    prompts = request.prompts
    counts = tuple(prompt_tokens(p) for p in prompts)
    first = prompts[0]
    counted = not any(isinstance(p, str) for p in prompts)
    if isinstance(request, EmbeddingRequest):
        return _Size(first, sum(counts), counts, 0, len(counts), counted=counted)
    choices = request.n * len(counts)
    return _Size(
        first,
        sum(counts),
        counts,
        request.output_tokens,
        choices,
        request.client_cap,
        counted=counted,
        cap_param=request.cap_param,
    )


def _shortens(fleet: FleetConfig, model: str) -> bool:
    """Whether ``model``'s engines serve a prompt whose budget passes the context, the
    budget shortened: vLLM does; SGLang refuses it (``_validate_one_request`` in its
    tokenizer_manager.py, unless started with ``--allow-auto-truncate``). Refused here
    too where every instance runs SGLang and the prompt came as token ids: passed on,
    the refusal would count as the DC's failure in its tables. A text's length here is
    an estimate, so SGLang judges it, and its refusal does count so."""
    return any(i.engine != "sglang" for i in fleet.instances if i.model == model)


def _output_budget(size: _Size, context_tokens: int, prompt_param: str, shortens: bool) -> int:
    """The tokens the request may generate, all its choices together, each prompt's
    budget as vLLM sets it (``context_budgets``); where the engines refuse a budget past
    the context (``shortens`` False), ApiError(400) for one. A prompt's length is
    judged against the context only where the client sent its token ids: a text's
    tokens here are an estimate, and one the engine would serve must not be refused
    on it (its own refusal passes back)."""
    budgets = context_budgets(
        size.prompts,
        size.choice_budget,
        size.client_cap,
        context_tokens,
        prompt_param,
        counted=size.counted,
        cap_param=size.cap_param,
    )
    longest = max(size.prompts)
    too_long = size.client_cap is not None and longest + size.client_cap > context_tokens
    if too_long and size.counted and not shortens:
        raise ApiError(
            400,
            f"This model's maximum context length is {context_tokens} tokens; the request "
            f"has {longest} prompt tokens and asks for {size.client_cap} more.",
            param=prompt_param,
        )
    return sum(budgets) * (size.choices // len(size.prompts))


def _task_class(
    value: str | None, tenant: TenantConfig, input_tokens: int, deadline_s: float | None
) -> TaskClass:
    """The class the client named, else its tenant's default, else what the request shows
    (``control.admission.request.identify``); ApiError 400 for an unknown name, 403 for a
    class the tenant may not send. A class told by the request alone that the tenant may
    not send falls back to interactive."""
    try:
        requested = None if value is None else TaskClass(value)
    except ValueError:
        known = ", ".join(c.value for c in TaskClass)
        raise ApiError(
            400, f"{CLASS_HEADER} must be one of {known}, not {value!r}.", param=CLASS_HEADER
        ) from None
    task_class = identify(
        requested=requested,
        tenant_default=tenant.default_class,
        input_tokens=input_tokens,
        has_deadline=deadline_s is not None,
    )
    if task_class not in tenant.classes and requested is None and tenant.default_class is None:
        task_class = TaskClass.INTERACTIVE
    if task_class not in tenant.classes:
        raise ApiError(403, f"Tenant {tenant.name!r} may not send {task_class.value} requests.")
    return task_class


def residency_of(headers: Mapping[str, str]) -> tuple[str, ...]:
    """The regions a request's data must stay in, as its residency header names them
    (none: anywhere); ApiError(400) for a header that names none, rather than read it as
    no restriction."""
    value = headers.get(RESIDENCY_HEADER)
    if value is None:
        return ()
    regions = tuple(region for part in value.split(",") if (region := part.strip()))
    if not regions:
        raise ApiError(
            400,
            f"{RESIDENCY_HEADER} must name at least one region (comma-separated).",
            param=RESIDENCY_HEADER,
        )
    if len(regions) > MAX_REGIONS or max(map(len, regions)) > MAX_NAME:
        raise ApiError(
            400,
            f"{RESIDENCY_HEADER} names at most {MAX_REGIONS} regions of at most {MAX_NAME} "
            "characters each.",
            param=RESIDENCY_HEADER,
        )
    return regions


MAX_REGIONS = 64
MAX_NAME = 256
"""Bounds on what a client names in a header: a region (as the events carry one) and an
``Idempotency-Key``; past them, 400 (before, a longer region failed the request's event
with a server error, and left its idempotency key held)."""


def idempotency_key_of(headers: Mapping[str, str]) -> str | None:
    """The request's ``Idempotency-Key``; ApiError(400) past ``MAX_NAME`` characters."""
    key = headers.get(IDEMPOTENCY_HEADER)
    if key is not None and not 0 < len(key) <= MAX_NAME:
        raise ApiError(
            400,
            f"{IDEMPOTENCY_HEADER} must have 1 to {MAX_NAME} characters.",
            param=IDEMPOTENCY_HEADER,
        )
    return key


def idempotency_scope(inbound: Inbound, key: str) -> str:
    """Where the answer to a request sent with Idempotency-Key ``key`` is kept: per tenant,
    path and body, so that the key sent again with another request runs that request (the
    first one's answer came back for it: a chat's to an embeddings call, a stream to a
    whole request). The tenant's name length first: "a:b" + "k" and "a" + "b:k" are two
    scopes; the digest is of fixed length."""
    digest = hashlib.sha256(inbound.path.encode() + b"\0" + inbound.body).hexdigest()[:32]
    return f"{len(inbound.tenant.name)}:{inbound.tenant.name}:{digest}:{key}"


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
