"""A trip's books: what one request on one instance counts, and reports, from the moment
it is charged to its end (the exchange, ``gateway.exchange``, carries the request itself).

- Shared accounting follows the request: its uncached prompt counts as pending prefill
  until the first token, its prompt and budget as in flight until it ends. A whole
  (non-streamed) answer shows no first token: its prefill stops counting when the router
  predicted the first token would come, or at its end if the router predicts nothing.
- Every end (completed, cancelled, failed, refused by the instance as invalid, abandoned
  by an unexpected exception or the server's stop) undoes what is left of the
  accounting, tells admission and emits one lifecycle event (an abandoned trip's is a
  failure, unless its end was already reported); one that did not complete frees its
  idempotency key for the client's retry.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from control.routing.snapshot import Observation
from gateway.admission import GatewayAdmission
from gateway.decide import Plan
from gateway.events import EventSink
from gateway.inbound import Inbound
from gateway.metrics import GatewayMetrics
from gateway.sse import Piece, Seen
from gateway.state import Outcome, SharedState
from schemas.fleet import InstanceConfig
from schemas.lifecycle import (
    CancelReason,
    FirstToken,
    RejectReason,
    RequestCancelled,
    RequestCompleted,
    RequestFailed,
    RequestRejected,
    RequestRetried,
)
from schemas.openai_api import REQUEST_ID_HEADER, ApiError

Spawn = Callable[[Coroutine[Any, Any, None]], None]
KEPT_ANSWER_BYTES = 8 * 1024 * 1024
"""The largest answer kept under an idempotency key for its retries: a streamed answer of
about 30,000 tokens (some 250 bytes an event), read back from Redis in 0.03 s on this
project's 2-core machine, well within the 0.5 s a call may take there. A larger answer
(logprobs on a long one) is not kept; its retries get a 409 saying so rather than running
again: a 24 MB answer timed the retry's claim out, and the key read as new ran the request
a second time."""


@dataclass
class Trip:
    """What the gateway tracks of one request on one instance."""

    inbound: Inbound
    plan: Plan
    row: int
    arrived: float
    idempotency_key: str | None
    sent_at: float = 0.0
    first_token_at: float | None = None
    output_tokens: int = 0
    error: str | None = None
    """An error the instance reported within its stream."""
    pending: float = 0.0
    inflight: float = 0.0
    captured: bytearray = field(default_factory=bytearray)
    reported: bool = False
    """Whether its end's lifecycle event was emitted."""
    stream_end: str = "cancelled"
    """How its relayed stream ended: ``completed``, ``cancelled`` (the client left first),
    or the instance's error."""
    sequence_number: int | None = None
    """The highest a Responses API event relayed carried: the gateway's own event, where
    the stream fails, takes the next."""

    @property
    def instance(self) -> InstanceConfig:
        return self.plan.pool.instances[self.row]

    @property
    def headers(self) -> dict[str, str]:
        """What its answer says of it: the request id, and the instance and DC it ran in."""
        return {
            REQUEST_ID_HEADER: self.inbound.request_id,
            "x-tokenfleet-instance": self.instance.id,
            "x-tokenfleet-dc": self.plan.dc,
        }

    def count(self, event: bytes, seen: Seen) -> bytes:
        """Count what ``event`` (read as ``seen``) tells of the answer; the event as it was."""
        if seen.output_tokens is not None:
            self.output_tokens = seen.output_tokens
        elif seen.piece is Piece.DELTA:
            self.output_tokens += 1
        if seen.error is not None:
            self.error = seen.error
        if seen.sequence_number is not None:
            self.sequence_number = max(seen.sequence_number, self.sequence_number or 0)
        if self.idempotency_key is not None and len(self.captured) <= KEPT_ANSWER_BYTES:
            self.captured.extend(event)  # past the limit it is not kept: no more needed
        return event


class TripBooks:
    """Closes the books of every trip of one gateway app."""

    def __init__(
        self,
        state: SharedState,
        events: EventSink,
        admission: GatewayAdmission,
        metrics: GatewayMetrics,
        spawn: Spawn,
        idempotency_ttl_s: float,
    ) -> None:
        self.state = state
        self.events = events
        self.admission = admission
        self.metrics = metrics
        self.spawn = spawn
        self.idempotency_ttl_s = idempotency_ttl_s

    def settle_at_predicted_first_token(self, trip: Trip) -> asyncio.TimerHandle | None:
        """Stop counting the trip's prefill as pending once the router's predicted TTFT
        has passed, as a first token would; the caller cancels the timer at the end.
        (TTFT is predicted from the decision, a few hundred microseconds earlier.)"""
        predicted = trip.plan.predicted_ttft_s(trip.row)
        if predicted is None:
            return None
        loop = asyncio.get_running_loop()
        return loop.call_later(max(predicted, 0.0), lambda: self.spawn(self._prefill_done(trip)))

    async def _prefill_done(self, trip: Trip) -> None:
        # Taken before the await: the end of the trip may release it meanwhile.
        pending, trip.pending = trip.pending, 0.0
        if pending:
            await self.state.adjust(trip.instance.id, -pending, 0.0)

    def first_token(self, trip: Trip) -> None:
        """Noted at once; the shared accounting follows in a task of its own, which a
        client that leaves cannot cancel half-way (this runs inside the response)."""
        trip.first_token_at = time.monotonic()
        inbound, ttft = trip.inbound, trip.first_token_at - trip.arrived
        self.admission.first_token(inbound, trip.plan.dc)
        self.spawn(self._prefill_done(trip))
        self.metrics.first_token(inbound.model.name, inbound.task_class.value, ttft)
        self.events.emit(
            FirstToken(request_id=inbound.request_id, instance_id=trip.instance.id, ttft_s=ttft)
        )

    async def completed(self, trip: Trip) -> None:
        await self.release(trip)
        now = time.monotonic()
        first = trip.first_token_at or now
        ttft, e2e = first - trip.arrived, now - trip.arrived
        tpot = (now - first) / (trip.output_tokens - 1) if trip.output_tokens > 1 else 0.0
        inbound = trip.inbound
        # Only a streamed answer shows its first token, and only the instance the router
        # chose was predicted for: a retry's TTFT would train the wrong instance.
        first_choice = trip.row == trip.plan.decision.chosen
        observation = (
            Observation(inbound.request_id, trip.row, first - trip.sent_at, trip.output_tokens)
            if inbound.stream and first_choice
            else None
        )
        self.admission.finished(inbound, trip.plan.dc, trip.output_tokens, observation)
        objective = self.admission.objectives.of(inbound.task_class, inbound.tenant.name)
        whole = None if inbound.stream else trip.output_tokens
        met = objective.met(ttft, tpot, e2e, inbound.deadline_s, whole_output_tokens=whole)
        task_class = inbound.task_class.value
        self.metrics.output_tokens.labels(task_class, str(met).lower()).inc(trip.output_tokens)
        self.metrics.completed(inbound.model.name, task_class, e2e)
        trip.reported = True
        self.events.emit(
            RequestCompleted(
                request_id=inbound.request_id,
                dc=trip.plan.dc,
                instance_id=trip.instance.id,
                task_class=inbound.task_class,
                tenant=inbound.tenant.name,
                input_tokens=inbound.input_tokens,
                cached_tokens=int(trip.plan.cached_tokens_at(trip.row)),
                output_tokens=trip.output_tokens,
                ttft_s=ttft,
                tpot_s=tpot,
                e2e_s=e2e,
                streamed=inbound.stream,
            )
        )
        if trip.idempotency_key is not None:
            kept = _kept(trip.captured, inbound.stream, trip.headers)
            await self.state.settle(trip.idempotency_key, kept, self.idempotency_ttl_s)

    async def cancelled(self, trip: Trip) -> None:
        await self.release(trip)
        self.admission.finished(trip.inbound, trip.plan.dc, cancelled=True)
        self.metrics.cancellations.inc()
        trip.reported = True
        self.events.emit(
            RequestCancelled(
                request_id=trip.inbound.request_id,
                instance_id=trip.instance.id,
                reason=CancelReason.CLIENT_DISCONNECT,
                output_tokens=trip.output_tokens,
                **attribution(trip.inbound, trip.plan.dc),
            )
        )
        await self._forget_key(trip)

    async def fail(self, trip: Trip, error: str) -> None:
        """The trip failed without a retry: undo its accounting, report it, free its key."""
        await self.release(trip)
        self.admission.finished(trip.inbound, trip.plan.dc)
        self._failed(trip, error)
        await self._forget_key(trip)

    async def refused(self, trip: Trip, status: int) -> None:
        """The instance refused the request for its own fault (``status``, one of
        ``gateway.upstream_answers.REQUEST_FAULTS``: a prompt past the context, a
        parameter the engine rejects, a stored response it lacks): nothing ran, so the
        router forgets the work it counted, and the request is reported refused as
        invalid in no DC's table; counted as the DC's failure, one tenant's bad requests
        would lower a healthy DC's goodput and move the weights off it."""
        await self.release(trip)
        self.admission.finished(trip.inbound, trip.plan.dc, cancelled=True)
        # Counted per instance: a fleet misconfigured (engines not started for priority
        # scheduling, a context the fleet file overstates) shows as one instance refusing.
        self.metrics.upstream_failed(trip.instance.id, "refused")
        trip.reported = True
        self.events.emit(
            RequestRejected(
                request_id=trip.inbound.request_id,
                reason=RejectReason.INVALID,
                detail=f"instance {trip.instance.id} answered {status}",
            )
        )
        await self._forget_key(trip)

    async def abandoned(self, trip: Trip, why: BaseException) -> None:
        """A trip that ended by an unexpected exception (``why``; a cancellation where the
        server stops): nothing of it stays counted, and unless its end was reported, it
        is reported failed, so that the tables count what its client did not get."""
        if not trip.reported:
            self._failed(trip, f"the gateway gave it up ({type(why).__name__})")
        await self.release(trip)
        self.admission.finished(trip.inbound, trip.plan.dc)
        await self._forget_key(trip)

    async def _forget_key(self, trip: Trip) -> None:
        """A request that did not complete leaves its idempotency key free for a retry."""
        if trip.idempotency_key is not None:
            await self.state.release(trip.idempotency_key)

    def _failed(self, trip: Trip, error: str) -> None:
        trip.reported = True
        self.events.emit(
            RequestFailed(
                request_id=trip.inbound.request_id,
                instance_id=trip.instance.id,
                error=error,
                output_tokens=trip.output_tokens,
                **attribution(trip.inbound, trip.plan.dc),
            )
        )

    async def release(self, trip: Trip) -> None:
        """Undo what is left of the trip's accounting, and tell a router that counts its
        requests that this one left the instance (the retry of a failed first choice is
        not counted again: the router did not choose it)."""
        self.admission.left_instance(trip.inbound, trip.plan.dc)
        pending, inflight = trip.pending, trip.inflight
        trip.pending = trip.inflight = 0.0
        await self.state.adjust(trip.instance.id, -pending, -inflight)

    def retried(self, trip: Trip, first_row: int) -> None:
        self.metrics.retries.inc()
        self.events.emit(
            RequestRetried(
                request_id=trip.inbound.request_id,
                attempt=2,
                from_instance=trip.plan.pool.instances[first_row].id,
                to_instance=trip.instance.id,
                reason="upstream failed before the first token",
            )
        )


def attribution(inbound: Inbound, dc: str) -> dict[str, Any]:
    """What an early end's event says of where and whose the request was."""
    return {"dc": dc, "task_class": inbound.task_class, "tenant": inbound.tenant.name}


def _kept(answer: bytearray, streamed: bool, headers: dict[str, str]) -> Outcome:
    """What a completed request's retries get: its answer, or where that is too large to
    keep, a 409 in OpenAI's format; with its ``headers`` either way."""
    if len(answer) <= KEPT_ANSWER_BYTES:
        media_type = "text/event-stream" if streamed else "application/json"
        return Outcome(200, media_type, bytes(answer), headers)
    refusal = ApiError(
        409,
        f"The request with this Idempotency-Key completed; its answer, over "
        f"{KEPT_ANSWER_BYTES} bytes, was too large to keep for a retry.",
    )
    return Outcome(409, "application/json", json.dumps(refusal.body()).encode(), headers)
