"""The gateway's HTTP app: OpenAI-compatible endpoints in front of the fleet.

Per request: authenticate -> read and size it -> idempotency check -> admit -> choose the
DC -> choose the instance -> proxy (``gateway.exchange``). The routes are those of vLLM's
OpenAI server: chat, completions, the Responses API and embeddings are proxied that way;
``/tokenize`` and ``/detokenize`` are passed to an instance as sent; anything else is an
OpenAI-format 404. A path is served with or without a trailing slash, never redirected.
Every error is answered in OpenAI's format. The app owns its background work (event
publishing, feeds) through its lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from control.admission.baselines import Fcfs
from control.admission.registry import Admission
from control.fleet.registry import make_dc_policy
from control.routing.registry import Router
from gateway.decide import CONTROLS, Decider
from gateway.events import EventSink
from gateway.exchange import Exchange, RelayedStream
from gateway.failures import CLIENT_LEFT, DcFailed
from gateway.fallback_state import FallbackState
from gateway.fleet_view import FleetView
from gateway.inbound import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    EMBEDDINGS_PATH,
    PROXIED_PATHS,
    RESPONSES_PATH,
    Inbound,
    authenticate,
    idempotency_key_of,
    idempotency_scope,
    model_named,
    only_model,
    read_inbound,
    residency_of,
)
from gateway.journal import Journals
from gateway.metrics import GatewayMetrics
from gateway.refusals import REFUSED_RETRY_AFTER_S, Refused
from gateway.settings import GatewaySettings
from gateway.state import IN_PROGRESS, Outcome, SharedState
from schemas.control import AdmissionQuotas, RoutingWeights
from schemas.fleet import FleetConfig, ModelConfig
from schemas.lifecycle import RejectReason, RequestArrived, RequestRejected
from schemas.openai_api import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    ResponsesRequest,
    UtilityRequest,
    parse_request,
)
from schemas.tables import GoodputTable
from schemas.telemetry import InstanceTelemetry, KvAllCleared, KvBlocksRemoved
from streams.bus import EventBus
from streams.feeds import follow

log = logging.getLogger(__name__)


@dataclass
class GatewayParts:
    """What a gateway is built from; the command line wires real ones, tests their own."""

    fleet: FleetConfig
    settings: GatewaySettings
    state: SharedState
    bus: EventBus
    make_router: Callable[[str], Router]
    """A fresh router for a model's pool (one per model and DC)."""
    make_admission: Callable[[str], Admission] = lambda _model: Fcfs()
    """A fresh admission policy for a model's pool (one per model and DC; the command
    line's default is SLOMax, ``TOKENFLEET_GATEWAY_ADMISSION``)."""
    recipe: Callable[[str], dict[str, Any]] | None = None
    """How ``make_router`` and ``make_admission`` build a model's pool (policy names,
    parameters, seed, profile), for the decision journal; None: no journal can be kept."""
    controls: frozenset[str] = CONTROLS
    """The controls a controller publishes to this gateway (``CONTROLS``: quotas,
    weights), each watched by a ``tokenfleet_gateway_control_defaults`` series; one
    nobody publishes would read 1 (on defaults) for ever."""


class Gateway:
    """One gateway's request path and background work, built from its parts: what
    ``create_app`` serves."""

    def __init__(self, parts: GatewayParts) -> None:
        settings, fleet = parts.settings, parts.fleet
        self.parts, self.settings, self.fleet = parts, settings, fleet
        self.metrics = metrics = GatewayMetrics(
            [i.id for i in fleet.instances], [dc.name for dc in fleet.dcs]
        )
        if isinstance(parts.state, FallbackState):
            parts.state.on_fallback = metrics.state_fallbacks.inc
        self.view = FleetView(fleet, settings.failure_cooldown_s, settings.failure_consecutive_5xx)
        self.local_dc = settings.dc or fleet.dcs[0].name
        self.regions = {dc.name: dc.region for dc in fleet.dcs}
        if self.local_dc not in self.regions:
            raise ValueError(f"the gateway's dc {self.local_dc!r} is not in the fleet file")
        self.events = EventSink(
            parts.bus,
            settings.name,
            settings.event_buffer,
            on_drop=metrics.events_given_up,
            on_published=metrics.count_published,
        )
        self.journals = self._journals()
        self.decider = Decider(
            self.view,
            parts.state,
            parts.make_router,
            self.local_dc,
            metrics,
            parts.make_admission,
            fleet.all_objectives(),
            make_dc_policy(settings.dc_policy),
            self.journals,
            parts.controls,
        )
        self._background: set[asyncio.Task[None]] = set()
        self.exchange = Exchange(
            parts.state,
            self.events,
            self.view,
            self.decider,
            metrics,
            self.spawn,
            settings.idempotency_ttl_s,
        )

    def _journals(self) -> Journals | None:
        settings = self.settings
        if not (settings.journal or settings.journal_file is not None):
            return None
        if self.parts.recipe is None:
            raise ValueError("a gateway keeps a journal only where its parts give their recipe")
        return Journals(
            settings.name,
            self.parts.recipe,
            settings.dc_policy,
            self.events.emit if settings.journal else None,
            settings.journal_file,
            on_lost=lambda: self.metrics.events_given_up("journal_write"),
        )

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in the background; the lifespan's end waits for it."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def on_telemetry(self, message: object) -> None:
        if isinstance(message, InstanceTelemetry):
            self.view.observe(message)

    def on_goodput(self, message: object) -> None:
        if isinstance(message, GoodputTable):
            self.view.observe_goodput(message)

    def on_kv_event(self, message: object) -> None:
        """Evictions correct the shared prefix index. Stored blocks add nothing: this
        gateway indexed what it sent when it sent it, and every replica applies the same
        events, which is harmless (removing twice removes once)."""
        if isinstance(message, KvBlocksRemoved):
            self.spawn(self.parts.state.evicted(message.instance_id, message.block_hashes))
        elif isinstance(message, KvAllCleared):
            self.spawn(self.parts.state.cleared(message.instance_id))

    def on_control(self, message: object) -> None:
        if isinstance(message, AdmissionQuotas):
            self.decider.quotas.offer(message)
        elif isinstance(message, RoutingWeights):
            self.decider.weights.offer(message)

    @contextlib.asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        self.exchange.client = _upstream_client(self.settings)
        await self.decider.admission.join()
        loops = [asyncio.create_task(work) for work in self._loops()]
        try:
            yield
        finally:
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            await asyncio.gather(*self._background, return_exceptions=True)
            await self.events.flush(timeout_s=2.0)
            if self.journals is not None:
                self.journals.close()
            await self.exchange.client.close()

    def _loops(self) -> list[Coroutine[Any, Any, None]]:
        """What runs while the gateway serves: event publishing, the feeds it follows,
        the shared state's reconcile and admission's releases."""
        bus = self.parts.bus
        return [
            self.events.run(),
            follow(bus, "tf.telemetry", self.on_telemetry, "latest"),
            follow(bus, "tf.kv-events", self.on_kv_event, "latest"),
            follow(bus, "tf.tables.goodput", self.on_goodput, "latest"),
            follow(bus, "tf.control.quotas", self.on_control, "earliest"),
            follow(bus, "tf.control.weights", self.on_control, "earliest"),
            _every(self.settings.share_sync_s, self.parts.state.reconcile),
            self.decider.admission.run(),
        ]

    def prometheus(self) -> Response:
        self.metrics.events_queued.set(self.events.queued)
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def proxied(self, request: Request, path: str) -> Response:
        """A request to a proxied endpoint, counted by model and status, and in progress
        until its answer ends (a stream's, when its response has ended)."""
        arrived = time.monotonic()
        metrics = self.metrics
        metrics.in_progress.inc()
        model, body = "-", b""
        streaming = False
        try:
            tenant = authenticate(self.fleet, request.headers.get("authorization"))
            body = await read_body(request, self.settings.max_body_bytes)
            inbound = read_inbound(self.fleet, tenant, path, body, request.headers)
            model = inbound.model.name
            try:
                response = await self._serve(inbound, request, arrived)
            except ApiError as exc:
                exc.request_id = inbound.request_id
                raise
            metrics.requests.labels(model, str(response.status_code)).inc()
            if streaming := isinstance(response, RelayedStream):
                response.on_end.append(metrics.in_progress.dec)
            return response
        except ApiError as exc:
            if model == "-":  # refused before it was read whole
                model = model_named(self.fleet, body) or model
            metrics.requests.labels(model, str(exc.status)).inc()
            raise
        finally:
            if not streaming:
                metrics.in_progress.dec()

    async def passed_through(self, request: Request) -> Response:
        """A request the instance answers as sent, e.g. ``/tokenize``: no admission,
        accounting or events; the least loaded instance of the model in the DC
        ``Decider.choose_dcs`` puts first among those its tenant and residency allow."""
        fleet = self.fleet
        tenant = authenticate(fleet, request.headers.get("authorization"))
        body = await read_body(request, self.settings.max_body_bytes)
        name = parse_request(UtilityRequest, body).model or only_model(fleet)
        if fleet.model(name) is None:
            raise ApiError(404, f"The model `{name}` does not exist.", param="model")
        residency = residency_of(request.headers)
        plan = await self.decider.least_loaded(name, tenant=tenant, residency=residency)
        return await self.exchange.forward(plan, request.url.path, body)

    async def _serve(self, inbound: Inbound, request: Request, arrived: float) -> Response:
        """Idempotency, the quota, the DCs in turn; a refusal is published as rejected."""
        state = self.parts.state
        key = idempotency_key_of(request.headers)
        scoped = idempotency_scope(inbound, key) if key else None
        if scoped is not None:
            held = await state.claim(scoped, self.settings.idempotency_ttl_s)
            if isinstance(held, Outcome):
                return Response(
                    held.body,
                    held.status,
                    media_type=held.media_type,
                    headers={**held.headers, "idempotent-replayed": "true"},
                )
            if held is IN_PROGRESS:
                raise ApiError(409, "A request with this Idempotency-Key is still running.")
        handed = False  # to the exchange, which frees the key where it fails otherwise
        try:
            self.events.emit(_arrived_event(inbound, self.regions[self.local_dc]))
            async with self.decider.quota_taken(inbound):
                dcs = self.decider.choose_dcs(
                    inbound.model.name,
                    inbound.tenant,
                    inbound.residency,
                    inbound.input_tokens,
                    inbound.task_class,
                    inbound.request_id,
                    inbound.blocks,
                )
                handed = True
                return await self._in_turn(dcs, inbound, request, arrived, scoped)
        except BaseException as exc:  # an answer refused, or anything before the exchange
            if scoped is not None and (isinstance(exc, ApiError) or not handed):
                await state.release(scoped)
            if isinstance(exc, ApiError) and exc.status in _REJECTIONS:
                self.events.emit(_rejected_event(inbound, exc))
            raise

    async def _in_turn(
        self,
        dcs: tuple[str, ...],
        inbound: Inbound,
        request: Request,
        arrived: float,
        scoped: str | None,
    ) -> Response:
        """Serve in the first DC; one that refuses the request or fails it before its
        first token passes it to the next (FleetMind's fallback). The last DC's answer
        stands, save that its refusal of a request out of reach after an earlier DC
        failed it is the fleet's doing, not the client's: 503, not 429. A refusal because
        this gateway is stopping is answered at once, from whichever DC: sending the
        request on would keep the stop waiting for it."""
        failed: DcFailed | None = None
        for dc in dcs[:-1]:
            try:
                return await self._in_dc(dc, inbound, request, arrived, scoped)
            except Refused as refused:
                if refused.stopping:
                    raise
                self.metrics.dc_fallbacks.labels(dc, "Refused").inc()
            except DcFailed as failure:
                self.metrics.dc_fallbacks.labels(dc, "DcFailed").inc()
                failed = failure
        try:
            return await self._in_dc(dcs[-1], inbound, request, arrived, scoped)
        except DcFailed as failure:
            self.exchange.failed(inbound, failure)
            raise
        except Refused as refused:
            if failed is None or refused.stopping or refused.reason is not RejectReason.DEADLINE:
                raise
            raise _late_after(failed, refused, dcs[-1]) from refused

    async def _in_dc(
        self, dc: str, inbound: Inbound, request: Request, arrived: float, scoped: str | None
    ) -> Response:
        """Serve in ``dc``; a refusal of its admission names it (the tables count the
        request there), one of the gateway's stop does not."""
        try:
            with self.decider.on_its_way(inbound, dc):
                return await self.exchange.serve(inbound, dc, request, arrived, scoped)
        except Refused as refused:
            if not refused.stopping:
                refused.dc = dc
            raise


def create_app(parts: GatewayParts) -> FastAPI:
    """The gateway's HTTP app over a ``Gateway`` built from ``parts``."""
    gateway = Gateway(parts)
    app = GatewayApp(
        title="TokenFleet gateway", version="1", lifespan=gateway.lifespan, redirect_slashes=False
    )
    app.state.gateway = gateway
    fleet = parts.fleet

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(ClientDisconnect)
    async def _gone(_: Request, exc: ClientDisconnect) -> Response:
        return Response(status_code=CLIENT_LEFT)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return error_response(UNEXPECTED)  # Starlette logs the traceback

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        detail = str(exc.detail)
        if exc.status_code in (404, 405):
            detail = f"{detail}: {request.method} {request.url.path}"
        error = ApiError(exc.status_code, detail)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.get("/health")
    async def health() -> dict[str, str]:
        """The process is up."""
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Some instance of the fleet can take requests (503 when none can)."""
        ok = gateway.view.any_ready()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return gateway.prometheus()

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authenticate(fleet, request.headers.get("authorization"))
        return {"object": "list", "data": [_model_card(m) for m in fleet.models]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        authenticate(fleet, request.headers.get("authorization"))
        found = fleet.model(model_id)
        if found is None:
            raise ApiError(404, f"The model `{model_id}` does not exist.", param="model")
        return _model_card(found)

    @app.post(CHAT_PATH, openapi_extra=_body_schema(ChatRequest))
    async def chat(request: Request) -> Response:
        """Chat completion, streamed (SSE) or whole, by the chosen instance."""
        return await gateway.proxied(request, CHAT_PATH)

    @app.post(COMPLETIONS_PATH, openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        """Text completion of one prompt or several, streamed (SSE) or whole."""
        return await gateway.proxied(request, COMPLETIONS_PATH)

    @app.post(RESPONSES_PATH, openapi_extra=_body_schema(ResponsesRequest))
    async def responses(request: Request) -> Response:
        """A Responses API answer, streamed (SSE) or whole, by the chosen instance."""
        return await gateway.proxied(request, RESPONSES_PATH)

    @app.post(EMBEDDINGS_PATH, openapi_extra=_body_schema(EmbeddingRequest))
    async def embeddings(request: Request) -> Response:
        """Embeddings, by the least loaded instance of the model."""
        return await gateway.proxied(request, EMBEDDINGS_PATH)

    @app.post("/tokenize", openapi_extra=_body_schema(UtilityRequest))
    async def tokenize(request: Request) -> Response:
        """The model's tokens for a prompt or messages, by one of its instances."""
        return await gateway.passed_through(request)

    @app.post("/detokenize", openapi_extra=_body_schema(UtilityRequest))
    async def detokenize(request: Request) -> Response:
        """The text of the model's tokens, by one of its instances."""
        return await gateway.passed_through(request)

    app.fast_lane = dict(
        zip(PROXIED_PATHS, (chat, completions, responses, embeddings), strict=True)
    )
    if parts.settings.cors_allow_origins:
        app.cors = CORSMiddleware(
            app.route_request,
            allow_origins=parts.settings.cors_allow_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    return app


def _model_card(model: ModelConfig) -> dict[str, Any]:
    return {
        "id": model.name,
        "object": "model",
        "created": 0,
        "owned_by": "tokenfleet",
        "max_model_len": model.context_tokens,
    }


class GatewayApp(FastAPI):
    """The FastAPI app with a fast lane in front: the proxied endpoints are answered
    straight from ASGI, and every path is served with or without its trailing slash.

    The routes stay declared on the app (they describe the endpoints in the OpenAPI
    document), but every POST to them is served here, before FastAPI's own ``__call__``:
    its router, dependency solving and middlewares (server errors, OpenTelemetry's
    check of its configuration, the body limit, exception handlers) cost about a quarter
    of the gateway's CPU per request, for endpoints that read their body themselves and
    raise only ``ApiError`` (anything else answers an OpenAI-format 500). So middleware
    added to the app, and FastAPI's OpenTelemetry spans where it is configured, do not
    see these endpoints: the gateway's own metrics and lifecycle events cover them.

    A request from a browser (one with an ``Origin``) passes through ``cors`` first, where
    the gateway allows any origin: a preflight is answered, and the answer carries
    ``Access-Control-Allow-Origin``, on every path, as vLLM's server does.
    """

    fast_lane: Mapping[str, Callable[[Request], Awaitable[Response]]] = MappingProxyType({})
    cors: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.cors is not None and scope["type"] == "http" and _has_origin(scope):
            await self.cors(scope, receive, send)
        else:
            await self.route_request(scope, receive, send)

    async def route_request(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            if len(path) > 1 and path.endswith("/"):  # clients written for vLLM are not redirected
                scope = {**scope, "path": path.rstrip("/") or "/"}
            route = self.fast_lane.get(scope["path"]) if scope["method"] == "POST" else None
            if route is not None:
                scope["app"] = self
                await _serve_fast(route, scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def _has_origin(scope: Scope) -> bool:
    return any(name == b"origin" for name, _ in scope["headers"])


async def _serve_fast(
    route: Callable[[Request], Awaitable[Response]], scope: Scope, receive: Receive, send: Send
) -> None:
    try:
        response = await route(Request(scope, receive))
    except ApiError as exc:
        response = error_response(exc)
    except asyncio.CancelledError:
        if not scope["app"].state.gateway.decider.admission.closing:
            raise
        response = error_response(_cut_at_stop())
    except ClientDisconnect:  # gone while it sent the body: nobody to answer
        response = Response(status_code=CLIENT_LEFT)
    except Exception:  # a bug: still an answer in OpenAI's format, and a traceback logged
        log.exception("the gateway failed on %s", scope["path"])
        response = error_response(UNEXPECTED)
    await response(scope, receive, send)


UNEXPECTED = ApiError(500, "The gateway failed on this request; its log has the details.")


def _cut_at_stop() -> ApiError:
    """The answer to a request the gateway's stop cut, its body being read or its answer
    waited for (uvicorn cancels what runs past the drain): as a stop answers a held
    request, where the server gave a plain-text 500 and logged a traceback for each. Its
    books were closed on the way out."""
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()  # answered: the cancellation is spent
    message = "The gateway stopped before this request's answer; send it again."
    return ApiError(503, message, retry_after_s=REFUSED_RETRY_AFTER_S)


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


async def _every(period_s: float, work: Callable[[], Awaitable[None]]) -> None:
    """Run ``work`` every ``period_s`` until cancelled; a failed round is logged, not fatal."""
    while True:
        await asyncio.sleep(period_s)
        try:
            await work()
        except Exception:
            log.exception("periodic %s failed", getattr(work, "__name__", work))


def _upstream_client(settings: GatewaySettings) -> aiohttp.ClientSession:
    """One pooled client for every upstream call (aiohttp: on a small machine it costs
    about a third of what httpx does per call)."""
    timeout = aiohttp.ClientTimeout(
        total=None,
        sock_connect=settings.upstream_connect_timeout_s,
        sock_read=settings.upstream_read_timeout_s,
    )
    # Idle connections closed before the servers close them: vLLM's and SGLang's uvicorn
    # drop one after 5 s, and a request sent on a connection being closed fails, which
    # would count against a healthy instance.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4)
    # Answers are relayed as their bytes came: asked for uncompressed (aiohttp asks for
    # gzip by default), since a proxy between that compressed them would hand the
    # gateway bytes it cannot read (a failed instance) and the client bytes without
    # their ``Content-Encoding``.
    return aiohttp.ClientSession(
        timeout=timeout,
        connector=connector,
        auto_decompress=False,
        headers={"accept-encoding": "identity"},
    )


_REJECTIONS = {429: RejectReason.QUOTA, 503: RejectReason.NO_CAPACITY}


def _late_after(failure: DcFailed, refusal: Refused, dc: str) -> Refused:
    """``dc``'s refusal, as out of reach of its objective, of a request that ``failure``'s
    DC had taken and then failed before its first token: the time it spent there made it
    late, so the client learns of both, as a server-side 503 (with the refusal's
    ``Retry-After``). Any other refusal (a limit reached, a pool full) stays as it was:
    waiting did not cause it."""
    message = (
        f"DC {failure.dc} failed it before the first token ({failure.error}), and DC {dc} "
        f"then refused it: {refusal.message}"
    )
    return Refused(503, message, refusal.reason, refusal.retry_after_s, dc)


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, or ApiError(413) once it is read past ``limit`` bytes. The rest
    is read and dropped before the answer (up to ``DRAINED_AT_MOST``): a server that
    answers while its client still sends resets the connection, and the client sees no
    answer at all."""
    too_large = ApiError(413, f"The request body exceeds {limit} bytes.", param="body")
    declared = request.headers.get("content-length", "")
    expecting = request.headers.get("expect", "").lower() == "100-continue"
    if expecting and declared.isdigit() and int(declared) > limit:
        raise too_large  # the client waits for a go-ahead: refuse before it uploads

    body = bytearray()
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received <= limit:
            body += chunk
        elif received > DRAINED_AT_MOST:
            break
    if received > limit:
        raise too_large
    return bytes(body)


DRAINED_AT_MOST = 256 * 1024 * 1024
"""Bytes of an oversized body read before the 413 regardless (the connection then closes)."""


def _rejected_event(inbound: Inbound, refusal: ApiError) -> RequestRejected:
    return RequestRejected(
        request_id=inbound.request_id,
        reason=refusal.reason if isinstance(refusal, Refused) else _REJECTIONS[refusal.status],
        detail=refusal.message,
        retry_after_s=refusal.retry_after_s,
        dc=refusal.dc if isinstance(refusal, Refused) else None,
    )


def _arrived_event(inbound: Inbound, region: str) -> RequestArrived:
    return RequestArrived(
        request_id=inbound.request_id,
        tenant=inbound.tenant.name,
        task_class=inbound.task_class,
        model=inbound.model.name,
        input_tokens=inbound.input_tokens,
        output_budget=inbound.output_budget,
        prefix_blocks=inbound.blocks,
        source_region=region,
        residency=inbound.residency,
        deadline_s=inbound.deadline_s,
    )


def _body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """Describe the JSON body in the OpenAPI document (the handlers parse it themselves,
    to answer errors in OpenAI's format)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
