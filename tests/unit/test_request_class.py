"""Which class a request through the gateway is, and what it is held to."""

from __future__ import annotations

import json

import pytest

from control.tokens import token_ids
from gateway.inbound import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    EMBEDDINGS_PATH,
    RESPONSES_PATH,
    Inbound,
    read_inbound,
)
from schemas.base import TaskClass
from schemas.fleet import FleetConfig
from schemas.objectives import ClassObjective
from schemas.openai_api import ApiError
from tests.gateway_harness import fleet_for

BODY = json.dumps({"model": "emulated", "messages": [{"role": "user", "content": "hi"}]})


def fleet(**tenant: object) -> FleetConfig:
    return fleet_for(["http://127.0.0.1:1"], tenants=[{"name": "t", "api_keys": ["k"], **tenant}])


def task_class(chosen: FleetConfig, **headers: str) -> TaskClass:
    tenant = chosen.tenants[0]
    return read_inbound(chosen, tenant, CHAT_PATH, BODY.encode(), headers).task_class


def test_the_class_comes_from_the_header_then_the_tenant_then_the_request() -> None:
    assert task_class(fleet()) is TaskClass.INTERACTIVE
    assert task_class(fleet(), **{"x-tokenfleet-deadline-s": "60"}) is TaskClass.BATCH
    by_default = fleet(default_class="long_document")
    assert task_class(by_default) is TaskClass.LONG_DOCUMENT
    assert task_class(by_default, **{"x-tokenfleet-class": "interactive"}) is TaskClass.INTERACTIVE


def test_a_class_the_tenant_may_not_send_is_refused_unless_only_the_request_told_it() -> None:
    chats_only = fleet(classes=["interactive"])
    with pytest.raises(ApiError) as refused:
        task_class(chats_only, **{"x-tokenfleet-class": "batch"})
    assert refused.value.status == 403
    # a deadline alone would make it batch, which this tenant does not send: a chat
    assert task_class(chats_only, **{"x-tokenfleet-deadline-s": "60"}) is TaskClass.INTERACTIVE
    with pytest.raises(ValueError, match="default_class 'batch' is not among its classes"):
        fleet(classes=["interactive"], default_class="batch")


def test_a_tenant_s_objectives_override_the_fleet_s_for_its_requests_only() -> None:
    chosen = fleet(objectives={"interactive": {"ttft_s": 0.5}})
    objectives = chosen.all_objectives()
    assert objectives.of(TaskClass.INTERACTIVE, "t") == ClassObjective(ttft_s=0.5)
    assert objectives.of(TaskClass.INTERACTIVE, "other") == ClassObjective(ttft_s=2.0, tpot_s=0.1)
    assert objectives.of(TaskClass.BATCH, "t") == ClassObjective(use_deadline=True)


def test_tools_and_tool_calls_count_in_a_chat_s_prompt_tools_first() -> None:
    """A chat template writes both into the prompt. Uncounted, 2 MB of tools read as 11
    tokens: a chat under every token quota and context check."""
    tools = [
        {"type": "function", "function": {"name": f"tool_{n}", "description": "d" * 400}}
        for n in range(50)
    ]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "x" * 4000}}

    def read(messages: list[dict[str, object]], **extra: object) -> tuple[int, tuple[int, ...]]:
        body = json.dumps({"model": "emulated", "messages": messages, **extra}).encode()
        inbound = read_inbound(fleet(), fleet().tenants[0], CHAT_PATH, body, {})
        return inbound.input_tokens, inbound.blocks

    bare, _ = read([{"role": "user", "content": "hi"}])
    with_tools, first = read([{"role": "user", "content": "hi"}], tools=tools)
    _, second = read([{"role": "user", "content": "something else"}], tools=tools)
    assert with_tools > bare + 5_000  # 50 tools of 400 characters and more
    shared = len(first) - 1  # the tool list is a prefix the two chats share
    assert first[:shared] == second[:shared]
    called, _ = read([{"role": "assistant", "content": None, "tool_calls": [call]}])
    assert called > 1_000


def test_a_budget_past_the_context_is_shortened_as_vllm_does_and_counted_shortened() -> None:
    chosen = fleet()
    context = chosen.models[0].context_tokens

    def read(path: str, **body: object) -> Inbound:
        data = json.dumps({"model": "emulated", **body}).encode()
        return read_inbound(chosen, chosen.tenants[0], path, data, {})

    chat = read(CHAT_PATH, messages=[{"role": "user", "content": "abcd" * 8000}], max_tokens=500)
    assert chat.output_budget == chat.client_cap == context - chat.input_tokens
    prompts = ["abcd" * (context - 100), "abcd" * 100]  # the first leaves 100 tokens
    both = read(COMPLETIONS_PATH, prompt=prompts, max_tokens=500, n=2)
    assert both.output_budget == 2 * (100 + 500)
    refused = [
        (CHAT_PATH, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": context + 1}),
        (COMPLETIONS_PATH, {"prompt": [7] * context, "max_tokens": 1}),
        (EMBEDDINGS_PATH, {"input": [7] * (context + 1)}),
    ]
    for path, body in refused:
        with pytest.raises(ApiError) as too_long:
            read(path, **body)
        assert too_long.value.status == 400
        assert "maximum context length" in str(too_long.value)
    assert read(EMBEDDINGS_PATH, input=[7] * context).output_budget == 0


def test_a_text_s_estimated_length_refuses_nothing() -> None:
    """A text's tokens are estimated here (4 bytes a token), where the engine's tokenizer
    may count fewer: a prompt near the context that the engine would serve was refused.
    Passed on, each such prompt is counted at the budget it asked."""
    chosen = fleet()
    context = chosen.models[0].context_tokens
    sglang = chosen.model_copy(
        update={"instances": [i.model_copy(update={"engine": "sglang"}) for i in chosen.instances]}
    )
    over = "abcd" * (context + 10)
    asked = [
        (chosen, CHAT_PATH, {"messages": [{"role": "user", "content": over}], "max_tokens": 5}),
        (sglang, CHAT_PATH, {"messages": [{"role": "user", "content": over}], "max_tokens": 5}),
        (chosen, COMPLETIONS_PATH, {"prompt": [over, "hi"], "max_tokens": 5}),
        (chosen, EMBEDDINGS_PATH, {"input": over}),
    ]
    budgets = []
    for fleet_, path, body in asked:
        data = json.dumps({"model": "emulated", **body}).encode()
        budgets.append(read_inbound(fleet_, fleet_.tenants[0], path, data, {}).output_budget)
    assert budgets == [5, 5, 5 + 5, 0]


def test_where_every_instance_runs_sglang_a_budget_past_the_context_is_refused() -> None:
    """SGLang refuses what vLLM shortens: passed on, its 400 would count as the DC's
    failure."""
    vllm = fleet()
    sglang = vllm.model_copy(
        update={"instances": [i.model_copy(update={"engine": "sglang"}) for i in vllm.instances]}
    )
    context = vllm.models[0].context_tokens
    body = {"model": "emulated", "prompt": [7] * 8000}
    asked = json.dumps(body | {"max_tokens": 500}).encode()
    with pytest.raises(ApiError) as too_long:
        read_inbound(sglang, sglang.tenants[0], COMPLETIONS_PATH, asked, {})
    assert (too_long.value.status, too_long.value.param) == (400, "prompt")
    unasked = read_inbound(
        sglang, sglang.tenants[0], COMPLETIONS_PATH, json.dumps(body).encode(), {}
    )
    assert unasked.output_budget <= context - unasked.input_tokens  # no cap: none refused
    assert read_inbound(vllm, vllm.tenants[0], COMPLETIONS_PATH, asked, {}).output_budget > 0


def test_a_prompt_sent_as_token_ids_is_routed_on_the_blocks_of_its_text() -> None:
    chosen = fleet()
    text = "a shared system prompt, then a question " * 20

    def blocks(prompt: object) -> tuple[int, ...]:
        body = json.dumps({"model": "emulated", "prompt": prompt, "max_tokens": 5}).encode()
        return read_inbound(chosen, chosen.tenants[0], COMPLETIONS_PATH, body, {}).blocks

    assert blocks(token_ids(text)) == blocks(text) != ()


def test_a_request_naming_no_model_needs_a_fleet_of_one_model() -> None:
    one = fleet()
    two = one.model_copy(
        update={"models": (*one.models, one.models[0].model_copy(update={"name": "other"}))}
    )
    unnamed = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    assert read_inbound(one, one.tenants[0], COMPLETIONS_PATH, unnamed, {}).model.name == "emulated"
    with pytest.raises(ApiError) as which:
        read_inbound(two, two.tenants[0], COMPLETIONS_PATH, unnamed, {})
    assert (which.value.status, which.value.param) == (400, "model")
    assert "`other`" in which.value.message


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT_PATH, {"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        (CHAT_PATH, {"messages": [{"role": "user", "content": "hi"}]}, "max_completion_tokens"),
        (RESPONSES_PATH, {"input": "hi"}, "max_output_tokens"),
        (COMPLETIONS_PATH, {"prompt": "hi"}, "max_tokens"),
    ],
)
def test_a_cap_past_the_context_is_refused_naming_the_field_that_set_it(
    path: str, body: dict[str, object], param: str
) -> None:
    """The error named max_tokens whichever field the client had set."""
    chosen = fleet()
    over = chosen.models[0].context_tokens + 1
    data = json.dumps({"model": "emulated", **body, param: over}).encode()
    with pytest.raises(ApiError) as refused:
        read_inbound(chosen, chosen.tenants[0], path, data, {})
    assert (refused.value.status, refused.value.param) == (400, param)
