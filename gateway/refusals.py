"""How an admission refusal becomes an OpenAI-format error: its HTTP status (429 at the
door, 503 after a wait or at the gateway's stop), its ``Retry-After``, and the reason the
lifecycle event reports."""

from __future__ import annotations

from typing import Any

from control.admission.view import EXPIRED, MAX_HOLD, SLOT_WAIT
from control.pipeline import Outcome
from schemas.lifecycle import RejectReason
from schemas.openai_api import ApiError

SHUTDOWN = "shutdown"
"""The reason a held request is answered when the gateway stops."""
OUT_OF_REACH = frozenset({"predicted_ttft", "predicted_tbt", "deadline", EXPIRED})
"""Admission's reasons that say the request could no longer meet its objective."""
OVER_LIMIT = frozenset({"concurrency", SLOT_WAIT, "priority_limit", "model_limit"})
"""Admission's reasons that say its class (or model) is at its limit; any other reason
says the fleet has no room (a full pool, the interactive reserve, saturation, ...)."""
REFUSED_RETRY_AFTER_S = 1.0
"""What a refusal tells the client to wait when its policy names no time."""
LONGEST_RETRY_AFTER_S = 60.0
"""What a refusal tells the client to wait where the wait has no end (a token bucket that
never refills), and the most it tells from a pool's expected drain: an estimate from the
last 30 s of releases says little of more than a minute ahead."""


class Refused(ApiError):
    """A refusal of the gateway's policies; ``reason`` is what the lifecycle event reports,
    ``dc`` the DC whose admission refused (None: refused before any DC took it), and
    ``stopping`` whether the gateway's stop answered it (no other DC is tried)."""

    def __init__(
        self,
        status: int,
        message: str,
        reason: RejectReason,
        retry_after_s: float | None = None,
        dc: str | None = None,
        *,
        stopping: bool = False,
    ) -> None:
        super().__init__(status, message, retry_after_s=retry_after_s)
        self.reason = reason
        self.dc = dc
        self.stopping = stopping


def rejected_for(admission_reason: str) -> RejectReason:
    """The lifecycle event's reason for one of admission's."""
    if admission_reason in OUT_OF_REACH:
        return RejectReason.DEADLINE
    if admission_reason in OVER_LIMIT:
        return RejectReason.QUOTA
    return RejectReason.NO_CAPACITY


def refusal(outcome: Outcome[Any], *, waited: bool, pool_wait_s: float = 0.0) -> ApiError:
    """429 for a request refused at the door, with ``Retry-After``; 503 for one that waited
    in its pool and can no longer meet its objective, or waited as long as its policy holds
    a request (the lifecycle event then says no capacity, not a deadline missed), or that
    the gateway's stop answered (that one may come straight back, to another replica).
    ``Retry-After`` is the policy's time, or 1 s, but no sooner than the class's pool is
    expected to have drained (``pool_wait_s``, across replicas; ``LONGEST_RETRY_AFTER_S``
    at most, and that where the pool holds requests while no instance is ready): a full
    pool told its clients 1 s, and a storm of retries met it still full. The simulator's
    clients keep to the policy's own time, as its benches were measured."""
    decision = outcome.admission
    task_class, reason = outcome.request.task_class.value, decision.reason
    why = rejected_for(reason)
    if reason == SHUTDOWN:
        message = "The gateway is stopping; send the request again."
        return Refused(503, message, why, REFUSED_RETRY_AFTER_S, stopping=True)
    if reason == MAX_HOLD:  # not an objective missed: the fleet had no room for it
        message = (
            f"This {task_class} request waited for capacity as long as the gateway holds "
            f"a request ({reason}); retry later."
        )
        return Refused(503, message, why)
    if waited:
        message = (
            f"This {task_class} request waited for capacity and can no longer meet its "
            f"objective ({reason})."
        )
        return Refused(503, message, why)
    message = f"The fleet cannot take this {task_class} request now ({reason}); retry later."
    named = decision.retry_after_s or REFUSED_RETRY_AFTER_S
    retry_after = max(named, min(pool_wait_s, LONGEST_RETRY_AFTER_S))
    return Refused(429, message, why, retry_after_s=retry_after)
