"""Process settings from the environment (prefix ``TOKENFLEET_``)."""

from __future__ import annotations

from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENFLEET_", frozen=True)

    kafka_bootstrap: str | None = None
    """``host:port`` of a Kafka broker; unset means: the local broker, if one runs."""
    redis_url: str | None = None
    """``redis://host:port/db``; unset means: the local server, if one runs."""
    redis_cluster: bool = False
    """Whether ``redis_url`` names a node of a Redis Cluster (the gateways' keys carry a hash
    tag per pool, so each decision's script runs on one node)."""
