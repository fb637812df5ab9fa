"""A request as admission sees it, and how its workload class is identified.

The class comes from what the client said, then from what its tenant sends by default,
then from the request itself: a deadline marks batch work, a prompt of
``LONG_DOCUMENT_TOKENS`` or more a long document, anything else is interactive.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.base import TaskClass
from schemas.objectives import ClassObjective

LONG_DOCUMENT_TOKENS = 16_384
"""A prompt this long or longer is a long document: it fills two whole prefill steps of
vLLM's default 8,192-token budget (0.58 s of prefill alone for Llama-3.1-70B on 4xH100
in the simulator's calibrated model), during which every chat on its instance waits."""


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    """What admission knows of a request: no body, only its class, owner and size."""

    request_id: str
    task_class: TaskClass
    tenant: str
    input_tokens: int
    output_budget: int | None
    """The client's ``max_tokens``; None where it set none."""
    arrival_s: float
    deadline_s: float | None = None
    """When it must have finished (absolute, on the host's clock); None: no deadline."""
    objective: ClassObjective | None = None
    """Its tenant's own objective for its class; None: the class's."""


PRIORITY = {TaskClass.INTERACTIVE: 0, TaskClass.LONG_DOCUMENT: 1, TaskClass.BATCH: 2}
"""Each class's priority where a scheme takes one number per request (vLLM's ``priority``,
llm-d's bands, Dynamo's tiers, LiteLLM's reservations): lower is served first, as an
operator would rank them, the tightest objective first."""


def identify(
    *,
    requested: TaskClass | None,
    tenant_default: TaskClass | None,
    input_tokens: int,
    has_deadline: bool,
) -> TaskClass:
    """The request's class: the one the client asked for, else its tenant's default, else
    the hints (a deadline: batch; a long prompt: long_document; else interactive)."""
    if requested is not None:
        return requested
    if tenant_default is not None:
        return tenant_default
    if has_deadline:
        return TaskClass.BATCH
    if input_tokens >= LONG_DOCUMENT_TOKENS:
        return TaskClass.LONG_DOCUMENT
    return TaskClass.INTERACTIVE
