"""The gateway's settings, from the environment (prefix ``TOKENFLEET_GATEWAY_``)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="TOKENFLEET_GATEWAY_", frozen=True, allow_inf_nan=False
    )

    fleet_file: Path = Path("fleet.toml")
    """The fleet file: DCs, models, instances (the only upstream URLs), tenants."""
    dc: str | None = None
    """The DC this gateway serves; unset: the fleet file's first DC."""
    policy: str | None = None
    """The routing policy, by the name ``tokenfleet sim --policy`` takes; unset: the fleet
    file's routing profile (TokenPilot when it names none)."""
    admission: str = "slomax"
    """The admission policy, by the name ``tokenfleet sim --admission`` takes (``fcfs``:
    admit everything, as a gateway without admission does)."""
    dc_policy: str = "fleetmind"
    """How the gateway picks the DC of each request, by name (``control.fleet.registry``)."""
    token_lag_s: float | None = Field(default=None, ge=0, le=1)
    """TokenPilot: from an engine step's end to its streamed tokens reaching this gateway
    (the engine's output path, detokenising, the network). TokenPilot places each
    candidate in its step from it (``docs/routing.md``, "The step in flight"), and
    assumes more when first tokens show this gateway later: the least lag assumed. Unset:
    the fleet file's routing profile, else TokenPilot's default (``TokenPilotParams``)."""
    name: str = Field(default_factory=lambda: f"gateway-{socket.gethostname()}-{os.getpid()}")
    """The ``source`` of this gateway's events."""
    event_buffer: int = Field(default=10_000, ge=1)
    """Lifecycle events held while Kafka is slow or away; beyond it they are dropped."""
    upstream_connect_timeout_s: float = Field(default=2.0, gt=0)
    upstream_read_timeout_s: float = Field(default=600.0, gt=0)
    """Longest silence from an instance within a stream (to its first event, between its
    chunks). A whole answer has none: vLLM sends its headers with its end, so its client's
    own timeout ends it."""
    drain_s: int = Field(default=25, ge=1)
    """At a stop (SIGTERM), how long requests in progress get to finish before they are cut
    (and their books closed): below the orchestrator's grace period (Kubernetes' 30 s;
    ``docker-compose.yml`` gives the gateways the drain and 10 s, as ``tokenfleet down`` does)."""
    failure_cooldown_s: float = Field(default=5.0, ge=0)
    """An instance whose call failed is left out of decisions this long."""
    failure_consecutive_5xx: int = Field(default=5, ge=1)
    """5xx answers in a row that fail an instance (Envoy's outlier detection default), a
    404 counted as one (the instance lacks the fleet's model name); a call that gets no
    answer fails it at once."""
    cors_allow_origins: list[str] = ["*"]
    """Origins a browser may call the gateway from (CORS), as vLLM's ``--allowed-origins``,
    whose default is every origin; ``[]``: no CORS headers, a preflight refused (405)."""
    idempotency_ttl_s: float = Field(default=600.0, gt=0)
    """How long an ``Idempotency-Key``'s outcome is kept."""
    redis_prefix: str = "tf:"
    """Prefix of every key the gateways share in Redis (one per fleet)."""
    share_sync_s: float = Field(default=2.0, gt=0)
    """How often a replica rewrites its share of the shared accounting from its own record."""
    share_ttl_s: float = Field(default=10.0, gt=0)
    """A replica's share that is not rewritten for this long (it died) stops counting; at
    least twice ``share_sync_s`` (a rewrite comes a sync and its own call's time after the
    last), or a live replica's share would lapse when one rewrite fails."""
    journal: bool = False
    """Publish the decision journal on ``tf.audit.journal``: every decision with the inputs
    it was made on and what its pipeline learned, for ``tokenfleet audit``. Needs Kafka
    (``TOKENFLEET_KAFKA_BOOTSTRAP``); without it, use ``journal_file``."""
    journal_file: Path | None = None
    """Append the decision journal to this file too (JSON lines, one envelope each)."""
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)

    @model_validator(mode="after")
    def _share_outlives_its_rewrites(self) -> GatewaySettings:
        if self.share_ttl_s < 2 * self.share_sync_s:
            raise ValueError(
                f"share_ttl_s ({self.share_ttl_s}) must be at least twice share_sync_s "
                f"({self.share_sync_s}): a live replica's share would lapse when one "
                "rewrite fails or runs late"
            )
        return self
