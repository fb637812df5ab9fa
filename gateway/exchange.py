"""One routed request's way through an instance: decide and charge, proxy, retry, relay.

- An instance that fails before the first token (connection error, 5xx, a stream that
  breaks early) gets the request once more at the next-best instance, counted as a
  retry, and is left out for a cooldown (after 5xx answers, only several in a row:
  ``FleetView.failed``); if that fails too, the DC failed it (``DcFailed``), and
  the edge may try the next DC. A stream that breaks after tokens reached the client ends
  as its API ends a failed stream (``gateway.sse.failure_events``); it is never run
  twice. Only the transport (a stream's body that ends before its end too) or an error
  status fails an instance, never the shape of a valid answer (an empty answer, a tool
  call, all reasoning). Whom a 4xx answer blames is ``gateway.upstream_answers``'s
  verdict.
- The first token is the first delta of any kind the instance streams (text, reasoning,
  a tool call's part, a Responses API ``*.delta`` event) or a choice's finish, whichever
  comes first; events before it (a role chunk, the Responses API's lifecycle events)
  wait for it, so that a failure before it can still be retried.
- A client that goes away aborts the upstream call (closing the connection cancels the
  request in vLLM) and is reported as a cancellation. It is watched from the moment the
  request is sent: a whole answer's headers come only with its end, and a stream's with
  its first token, so neither would otherwise learn of it during a queue wait or a
  long prefill.
- What the request counts and reports from its charge to its end are its trip's books
  (``gateway.trip``).

Clean-up after a stream runs as a task of its own, started when the response ends
(``RelayedStream``), however it ends: when a client disconnects, the ASGI server cancels
whatever awaits inside the response.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
import numpy as np
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from control.pipeline import Charge
from control.routing.tokenpilot import INDEX_STRIDE
from gateway.decide import Decider, Plan
from gateway.events import EventSink
from gateway.failures import CLIENT_LEFT, DcFailed, UpstreamFailed
from gateway.fleet_view import FleetView
from gateway.inbound import RESPONSES_PATH, Inbound
from gateway.metrics import GatewayMetrics
from gateway.sse import (
    FIRST_TOKEN,
    NOTHING,
    Piece,
    Seen,
    failure_events,
    output_tokens,
    read_event,
    sse_events,
)
from gateway.state import SharedState
from gateway.trip import Spawn, Trip, TripBooks, attribution
from gateway.upstream_answers import (
    UPSTREAM_ERRORS,
    Blame,
    blame,
    error_of,
    in_openai_format,
)
from schemas.fleet import InstanceConfig
from schemas.lifecycle import (
    CancelReason,
    CandidateScore,
    RequestCancelled,
    RequestFailed,
    RequestRouted,
)
from schemas.openai_api import ApiError

T = TypeVar("T")
log = logging.getLogger(__name__)

_JSON = {"content-type": "application/json"}

REPLANS = 2
"""Decisions made again at most, when other requests were routed since their view."""


class Exchange:
    """Serves routed requests; one per gateway app."""

    def __init__(
        self,
        state: SharedState,
        events: EventSink,
        view: FleetView,
        decider: Decider,
        metrics: GatewayMetrics,
        spawn: Spawn,
        idempotency_ttl_s: float,
    ) -> None:
        self.client: aiohttp.ClientSession | None = None
        """Set by the app's lifespan: a session belongs to the loop that serves."""
        self.state = state
        self.events = events
        self.view = view
        self.decider = decider
        self.metrics = metrics
        self.spawn = spawn
        self.books = TripBooks(state, events, decider.admission, metrics, spawn, idempotency_ttl_s)
        self._deciding = asyncio.Lock()
        self._headers = {i.id: _JSON | i.auth_headers(os.environ) for i in view.fleet.instances}
        """Per instance, the headers of a call to it (its key, where it has one)."""

    async def serve(
        self,
        inbound: Inbound,
        dc: str,
        request: Request,
        arrived: float,
        idempotency_key: str | None,
    ) -> Response:
        try:
            plan = await self._decide(inbound, dc, arrived, request)
        except ApiError:
            raise  # refused: the caller frees the key and reports it
        except ClientLeft:
            if idempotency_key is not None:  # free for the client's retry
                await self.state.release(idempotency_key)
            self.metrics.cancellations.inc()
            self.events.emit(
                RequestCancelled(
                    request_id=inbound.request_id,
                    reason=CancelReason.CLIENT_DISCONNECT,
                    **attribution(inbound, dc),
                )
            )
            return Response(status_code=CLIENT_LEFT)
        except BaseException:  # the server stopping while it was held, or a bug
            if idempotency_key is not None:
                await self.state.release(idempotency_key)
            raise
        self.events.emit(_routed_event(inbound, plan))
        order, answered = plan.order[:2], False
        for attempt, row in enumerate(order, start=1):
            trip = Trip(inbound, plan, row, arrived, idempotency_key)
            try:
                if attempt > 1:  # ``_reserve`` charged the first choice
                    self.books.retried(trip, order[0])
                    await self._charge(inbound, plan, row)
                # counted once charged: a client gone during the charge leaves nothing to undo
                trip.pending, trip.inflight = _charges(inbound, plan, row)
                response = await self._attempt(trip, request)
                if response.status_code != CLIENT_LEFT:  # the instance answered
                    self.view.served(trip.instance.id)
                return response
            except UpstreamFailed as exc:
                self.view.failed(trip.instance.id, status=exc.status)
                error, answered = str(exc), answered or exc.answered
            except BaseException as exc:  # a bug, or the server stopping: undo it all the same
                self.spawn(self.books.abandoned(trip, exc))
                raise
            try:  # only a failed attempt comes here
                await self.books.release(trip)
            except BaseException as exc:  # stopped meanwhile: its books still close
                self.spawn(self.books.abandoned(trip, exc))
                raise
        self.decider.admission.finished(inbound, plan.dc, cancelled=True)
        raise DcFailed(error, trip.instance.id, plan.dc, answered=answered)

    def failed(self, inbound: Inbound, failure: DcFailed) -> None:
        """Report a request whose last DC failed it before any token."""
        self.events.emit(
            RequestFailed(
                request_id=inbound.request_id,
                instance_id=failure.instance_id,
                error=failure.error,
                **attribution(inbound, failure.dc),
            )
        )

    async def _decide(self, inbound: Inbound, dc: str, arrived: float, request: Request) -> Plan:
        """Admit, route and charge the request, one request of this replica at a time:
        decided together, a burst's requests each read a view without the others, and the
        instances they were charged to depended on which charge reached the shared state
        first (one gateway given 8 prefix groups on 4 instances put 3 groups on one of
        them in 5 runs of 98; ``docs/gateway.md``). ``_reserve`` still settles conflicts
        with other replicas. A request held in its pool waits outside the lock, and one
        waiting for the lock is given up if its client leaves (a server does not cancel a
        request whose client left, and a queue of them was decided for nobody)."""
        if not await _lock_unless_gone(self._deciding, request):
            raise ClientLeft
        try:
            decided = await self.decider.decide(inbound, dc, arrived)
            if isinstance(decided, Plan):
                return await self._reserved(inbound, decided, locked=True)
        finally:
            self._deciding.release()
        plan = await _unless_gone(decided, request)
        return await self._reserved(inbound, plan, locked=False)

    async def _reserved(self, inbound: Inbound, plan: Plan, *, locked: bool) -> Plan:
        """``_reserve`` under the decision lock (taken here unless ``locked``); a client
        that leaves meanwhile, even while waiting for the lock, closes its books."""
        try:
            if locked:
                return await self._reserve(inbound, plan)
            async with self._deciding:
                return await self._reserve(inbound, plan)
        except BaseException:  # the client left: admission counted it in flight
            self.decider.admission.finished(inbound, plan.dc, cancelled=True)
            raise

    async def _reserve(self, inbound: Inbound, plan: Plan) -> Plan:
        """Charge the first choice in the shared state, unless another request was routed
        since the view it was decided on: then the router forgets it and decides again on
        a fresh view (at most ``REPLANS`` times, then the charge is written anyway).
        Decisions made at once, by replicas or by one replica's concurrent requests, would
        otherwise read the same view and pile a burst of new prefixes onto one instance.
        A router that cannot forget a decision is charged as it decided, at once."""
        replans = REPLANS if self.decider.admission.reroutes(inbound, plan.dc) else 0
        for replan in range(replans + 1):
            seen = plan.version if replan < replans else None
            if await self._charge(inbound, plan, plan.order[0], seen):
                break
            self.metrics.replans.inc()
            plan = await self.decider.reroute(inbound, plan.dc, plan.allowed)
        return plan

    async def _charge(
        self, inbound: Inbound, plan: Plan, row: int, seen_version: int | None = None
    ) -> bool:
        """Index the request's blocks on ``plan``'s instance ``row`` and count its tokens
        there (see ``SharedState.routed`` for ``seen_version``)."""
        pending, inflight = _charges(inbound, plan, row)
        instance = plan.pool.instances[row].id
        # at least one entry: Redis's script would read 0 as "keep none"
        capacity = max(self.view.prefix_capacity(instance) // INDEX_STRIDE, 1)
        return await self.state.routed(
            instance, plan.index_blocks, capacity, pending, inflight, seen_version
        )

    async def _attempt(self, trip: Trip, request: Request) -> Response:
        inbound = trip.inbound
        trip.sent_at = time.monotonic()
        self.metrics.added_latency.observe(trip.sent_at - trip.arrived)
        # A whole answer's headers come with its end: no first token is seen before.
        settling = None if inbound.stream else self.books.settle_at_predicted_first_token(trip)
        # Watched from the start: the answer's headers come with its end or first token.
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            body = self.decider.admission.upstream_body(inbound, trip.plan.dc, trip.instance.engine)
            posted = self._post(
                trip.instance, inbound.path, body, inbound.request_id, whole=not inbound.stream
            )
            upstream = await _unless_left(posted, gone)
            if upstream is None:
                return await self._left(trip)
            if upstream.status >= 400:  # the instance refused the request itself: pass it on
                try:
                    body = await upstream.read()
                except UPSTREAM_ERRORS as exc:
                    upstream.close()
                    raise UpstreamFailed(f"{trip.instance.id}: {type(exc).__name__}") from None
                upstream.release()
                whose, message = blame(upstream.status, body, inbound.model.name)
                if whose is Blame.INSTANCE:
                    self.metrics.upstream_failed(trip.instance.id, "status")
                    raise UpstreamFailed(
                        f"{trip.instance.id} answered {upstream.status}: {message}",
                        status=upstream.status,
                    )
                if whose is Blame.REQUEST:
                    await self.books.refused(trip, upstream.status)
                else:
                    await self.books.fail(trip, f"instance answered {upstream.status}")
                return Response(
                    in_openai_format(upstream.status, body),
                    upstream.status,
                    media_type="application/json",
                    headers=trip.headers,
                )
            if inbound.stream:
                return await self._stream(trip, upstream, gone)
            return await self._whole(trip, upstream, gone)
        finally:
            if settling is not None:
                settling.cancel()
            gone.cancel()  # past the first token, the streaming response watches

    async def forward(self, plan: Plan, path: str, body: bytes) -> Response:
        """Pass a request to ``plan``'s instance as sent, and its answer back as given,
        whatever its status (a 404 where the instance lacks the route); the next-best
        instance once if the first cannot be reached. Nothing is charged or reported: for
        cheap calls (``/tokenize``)."""
        assert self.client is not None, "the app's lifespan has not started"
        error = "no instance tried"
        for row in plan.order[:2]:
            instance = plan.pool.instances[row]
            try:
                headers = self._headers[instance.id]
                async with self.client.post(_url(instance, path), data=body, headers=headers) as up:
                    answer = await up.read()
                    return Response(answer, up.status, media_type=up.content_type)
            except UPSTREAM_ERRORS as exc:
                error = f"{instance.id}: {type(exc).__name__}"
                self.metrics.upstream_failed(instance.id, "connect")
                self.view.failed(instance.id)
        raise ApiError(502, f"The model instance failed: {error}")

    async def _post(
        self, instance: InstanceConfig, path: str, body: bytes, request_id: str, *, whole: bool
    ) -> aiohttp.ClientResponse:
        """The instance's response, its status below 500; UpstreamFailed otherwise. A
        ``whole`` answer has no read timeout: vLLM sends its headers with its end, so the
        silence is the generation itself, and a long one timed out as a failed instance,
        which was cooled down while the work ran again on another. Its client's own
        timeout ends it (a client that leaves cancels it). The gateway's request id goes
        as ``X-Request-Id``, which vLLM takes for its own request's id (its logs and
        traces then name the gateway's)."""
        assert self.client is not None, "the app's lifespan has not started"
        timeout = self.client.timeout
        if whole:
            timeout = _without_read_timeout(timeout)
        try:
            upstream = await self.client.post(
                _url(instance, path),
                data=body,
                headers=self._headers[instance.id] | {"x-request-id": request_id},
                timeout=timeout,
            )
        except UPSTREAM_ERRORS as exc:
            self.metrics.upstream_failed(instance.id, "connect")
            raise UpstreamFailed(f"{instance.id}: {type(exc).__name__}") from None
        if upstream.status >= 500:
            self.metrics.upstream_failed(instance.id, "status")
            why = await error_of(upstream)
            raise UpstreamFailed(
                f"{instance.id} answered {upstream.status}{why}", status=upstream.status
            )
        return upstream

    async def _whole(
        self, trip: Trip, upstream: aiohttp.ClientResponse, gone: asyncio.Future[None]
    ) -> Response:
        """Read the whole answer, unless the client leaves first (``gone``)."""
        try:
            body = await _unless_left(upstream.read(), gone)
        except UPSTREAM_ERRORS as exc:
            upstream.close()
            self.metrics.upstream_failed(trip.instance.id, "body")
            raise UpstreamFailed(
                f"{trip.instance.id}: {type(exc).__name__}", answered=True
            ) from None
        if body is None:
            return await self._left(trip, upstream)
        upstream.release()
        try:
            answer = json.loads(body)
        except ValueError as exc:
            self.metrics.upstream_failed(trip.instance.id, "body")
            raise UpstreamFailed(
                f"{trip.instance.id}: {type(exc).__name__}", answered=True
            ) from None
        trip.first_token_at = time.monotonic()  # unseen: a whole response counts TTFT as E2E
        trip.output_tokens = output_tokens(answer) or 0
        trip.captured.extend(body)
        await self.books.completed(trip)
        return Response(body, media_type="application/json", headers=trip.headers)

    async def _left(self, trip: Trip, upstream: aiohttp.ClientResponse | None = None) -> Response:
        """The client went away before its answer began: close the upstream call (closing
        the connection cancels the request in vLLM) and close the trip as cancelled."""
        if upstream is not None:
            upstream.close()
        await self.books.cancelled(trip)
        return Response(status_code=CLIENT_LEFT)

    async def _stream(
        self, trip: Trip, upstream: aiohttp.ClientResponse, gone: asyncio.Future[None]
    ) -> Response:
        """Relay the stream from its first token on; the events before it are held (a
        failure before it may still go to another instance), unless the client leaves
        first (``gone``)."""
        events = sse_events(upstream.content.iter_any())
        try:
            head = await _unless_left(_head(events), gone)
        except UPSTREAM_ERRORS as exc:
            upstream.close()
            self.metrics.upstream_failed(trip.instance.id, "before_first_token")
            raise UpstreamFailed(f"{trip.instance.id}: {type(exc).__name__}") from None
        if head is None:
            return await self._left(trip, upstream)
        last = head[-1][1] if head else NOTHING
        failed = _failed_before_first_token(last)
        if failed is not None:
            upstream.close()  # another instance may serve it
            self.metrics.upstream_failed(trip.instance.id, "before_first_token")
            raise UpstreamFailed(f"{trip.instance.id}: {failed}", status=last.status)
        if last.piece in FIRST_TOKEN:
            self.books.first_token(trip)
        return RelayedStream(
            self._relay(trip, upstream, head, events),
            on_end=lambda: self.spawn(self._stream_ended(trip, upstream, trip.stream_end)),
            headers=trip.headers,
        )

    async def _relay(
        self,
        trip: Trip,
        upstream: aiohttp.ClientResponse,
        head: list[tuple[bytes, Seen]],
        events: AsyncIterator[bytes],
    ) -> AsyncIterator[bytes]:
        """The stream's events, as they come; ``trip.stream_end`` says how it ended. A body
        that closes before the stream's end (``[DONE]``, an error, the Responses API's last
        event), which vLLM and SGLang always send, was cut short: by a proxy in front of
        the engine whose own upstream died, say. It fails as a broken connection does."""
        ended = False
        try:
            for event, seen in head:
                ended |= seen.piece is Piece.END
                yield trip.count(event, seen)
            async for event in events:
                seen = read_event(event)
                if seen.piece in FIRST_TOKEN:
                    if trip.first_token_at is None:
                        self.books.first_token(trip)
                    else:  # not the first: it may trail its step's end
                        self.view.tokens_streamed(trip.instance.id)
                ended |= seen.piece is Piece.END
                yield trip.count(event, seen)
            broke = CUT_SHORT
        except UPSTREAM_ERRORS as exc:
            broke = type(exc).__name__
        if ended:  # what broke after the stream's end lost nothing of it
            error = trip.error
            trip.stream_end = "completed" if error is None else f"{trip.instance.id}: {error}"
            return
        trip.stream_end = f"{trip.instance.id}: {broke}"
        self.metrics.upstream_failed(trip.instance.id, "after_first_token")
        message = f"The model instance failed mid-stream ({broke})."
        responses_api = trip.inbound.path == RESPONSES_PATH
        for failure in failure_events(message, trip.sequence_number, responses_api):
            yield failure

    async def _stream_ended(self, trip: Trip, upstream: aiohttp.ClientResponse, ended: str) -> None:
        if ended == "completed":
            upstream.release()
        else:
            upstream.close()  # closing the connection is how vLLM learns to abort
        if ended == "completed":
            await self.books.completed(trip)
        elif ended == "cancelled":
            await self.books.cancelled(trip)
        else:
            await self.books.fail(trip, ended)


CUT_SHORT = "its stream ended before its end"
"""Why a stream whose body closed before ``[DONE]`` (or the Responses API's last event)
failed."""


def _failed_before_first_token(last: Seen) -> str | None:
    """Why a stream that ended (or failed) before its first token failed, from its last
    event (``_head``'s); None where it has a token or ended as a stream ends. An engine's
    error of 500 or more, or a body that closed without an end: another instance may serve
    the request (a 4xx error in the stream is the request's, passed on)."""
    if last.piece is Piece.END and (last.status or 0) >= 500:
        return last.error
    return CUT_SHORT if last.piece is Piece.OTHER else None


async def _head(events: AsyncIterator[bytes]) -> list[tuple[bytes, Seen]]:
    """A stream's events up to its first token (or its end), each as read."""
    head: list[tuple[bytes, Seen]] = []
    async for event in events:
        head.append((event, seen := read_event(event)))
        if seen.piece is not Piece.OTHER:
            break
    return head


WRITE_STALL_S = 60.0
"""A stream whose client takes nothing for this long (its connection open, its reading
stopped) is given up as a client that left: waiting on it held the instance's sequence,
its charges and its admission slot for as long as the connection stayed open."""


class RelayedStream(StreamingResponse):
    """A relayed stream that calls each of ``on_end`` once it has ended, however it ended:
    after its last event, when its client left or stopped reading (``WRITE_STALL_S``), or
    when the server failed the response before the first (an ASGI 2.4 server raises from
    ``send`` once the client left; the body is then never iterated, and a ``finally``
    inside it would not run)."""

    def __init__(
        self, events: AsyncIterator[bytes], on_end: Callable[[], None], headers: dict[str, str]
    ) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self.on_end = [on_end]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_unless_stalled(message: Message) -> None:
            async with asyncio.timeout(WRITE_STALL_S):
                await send(message)

        try:
            await super().__call__(scope, receive, send_unless_stalled)
        except* TimeoutError:  # raised in starlette's task group
            log.info("a client took nothing of its stream for %.0f s: given up", WRITE_STALL_S)
        finally:
            for ended in self.on_end:
                ended()


@functools.cache
def _without_read_timeout(timeout: aiohttp.ClientTimeout) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(
        total=timeout.total, connect=timeout.connect, sock_connect=timeout.sock_connect
    )


def _url(instance: InstanceConfig, path: str) -> str:
    return f"{str(instance.url).rstrip('/')}{path}"


def _charges(inbound: Inbound, plan: Plan, row: int) -> tuple[float, float]:
    """What a request counts on ``plan``'s instance ``row`` (``Charge``): pending prefill
    and tokens in flight."""
    charge = Charge.of(inbound.input_tokens, inbound.output_budget, plan.cached_tokens_at(row))
    return charge.pending_prefill, float(charge.inflight_tokens)


def _routed_event(inbound: Inbound, plan: Plan) -> RequestRouted:
    decision = plan.decision
    rows = np.flatnonzero(np.isfinite(decision.scores))
    scores = decision.scores[rows].tolist()
    columns = {name: values[rows].tolist() for name, values in decision.parts.items()}
    candidates = tuple(
        CandidateScore(
            instance_id=plan.pool.ids[row],
            score=scores[n],
            parts={name: v[n] for name, v in columns.items() if math.isfinite(v[n])},
        )
        for n, row in enumerate(rows.tolist())
    )
    assert decision.chosen is not None
    return RequestRouted(
        request_id=inbound.request_id,
        dc=plan.dc,
        instance_id=plan.pool.ids[decision.chosen],
        policy=decision.policy,
        candidates=candidates,
    )


class ClientLeft(Exception):
    """The client went away while its request was held."""


async def _unless_gone(held: Awaitable[Plan], request: Request) -> Plan:
    """The held request's plan once released; ClientLeft (and the request withdrawn from
    its pool) if its client goes away first."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        plan = await _unless_left(held, gone)
    finally:
        gone.cancel()
    if plan is None:
        raise ClientLeft
    return plan


async def _lock_unless_gone(lock: asyncio.Lock, request: Request) -> bool:
    """Take ``lock``; False (and not taken) if the client goes away first. Watched only
    where taking it waits: a free lock with no request queued for it is taken at once."""
    if not lock.locked() and not getattr(lock, "_waiters", None):  # asyncio.Lock's queue
        await lock.acquire()
        return True
    gone = asyncio.ensure_future(_disconnected(request))
    taking = asyncio.ensure_future(lock.acquire())
    left = True  # also where this caller is cancelled while it waits
    try:
        await asyncio.wait({taking, gone}, return_when=asyncio.FIRST_COMPLETED)
        left = gone.done()
        return not left and taking.result()
    finally:
        gone.cancel()
        if left:  # given back if taken meanwhile; a pending take gives up its place
            taking.cancel()
            if taking.done() and not taking.cancelled():
                lock.release()


async def _unless_left(work: Awaitable[T], gone: asyncio.Future[None]) -> T | None:
    """What ``work`` gives, or None (and ``work`` cancelled) if the client goes first.
    Cancelled itself (the server's stop, past its drain), it cancels ``work`` too: left
    running, unwatched, its failure was logged as never retrieved."""
    doing = asyncio.ensure_future(work)
    watched: set[asyncio.Future[Any]] = {doing, gone}
    try:
        done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        if doing in done:
            return doing.result()
    finally:
        if not doing.done():
            doing.cancel()
            await asyncio.gather(doing, return_exceptions=True)
        elif not doing.cancelled():
            doing.exception()  # read: a failure this caller's cancellation left is not logged
    return None


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body was read, so only that can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
