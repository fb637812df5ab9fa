"""Process settings from the environment (prefix ``TOKENFLEET_``)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from urllib.parse import urlsplit

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def checked_bootstrap(text: str) -> str:
    """``text`` where it is one or more comma-separated ``host[:port]`` (an IPv6 host in
    brackets, a ``PLAINTEXT://`` prefix allowed; no port: 9092), as aiokafka and Faust
    take them; ValueError saying which is not (aiokafka answered a port that is no
    number with a bare ``invalid literal for int()``)."""
    for address in (part.strip() for part in text.split(",")):
        where = urlsplit("//" + address.split("://", 1)[-1])  # past a PLAINTEXT:// prefix
        try:
            usable = bool(where.hostname) and where.port != 0  # ValueError: a bad port
        except ValueError:
            usable = False
        if not usable:
            raise ValueError(f"a broker's address is host[:port], not {address!r}")
    return text


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENFLEET_", frozen=True)

    kafka_bootstrap: str | None = None
    """``host:port`` of a Kafka broker; unset means: the local broker, if one runs."""
    kafka_replication: int = Field(default=1, ge=1)
    """Brokers that keep each of the project's topics (``tokenfleet topics create`` and the
    topics the commands create) and the table worker's changelogs: 1 for one broker;
    on a cluster, 3 keeps them through a broker's loss (managed Kafka may require it)."""
    redis_url: str | None = None
    """``redis://[:password@]host:port/db``, the gateways' shared state; unset, each gateway
    keeps its own (and ``bench gateway`` starts a local server for its Redis rows)."""
    redis_cluster: bool = False
    """Whether ``redis_url`` names a node of a Redis Cluster (the gateways' keys carry a hash
    tag per pool, so each decision's script runs on one node)."""

    @field_validator("kafka_bootstrap")
    @classmethod
    def _addresses(cls, value: str | None) -> str | None:
        return None if value is None else checked_bootstrap(value)


OTHER_VARIABLES = ("TOKENFLEET_CACHE", "TOKENFLEET_CALIBRATION", "TOKENFLEET_TRACES")
"""Read where they are used (``os.environ``), not through a settings class."""
_IGNORED_PREFIX = "TOKENFLEET_TEST_"
"""The test suite's own (``tests/services.py``)."""


def _settings_classes() -> tuple[type[BaseSettings], ...]:
    from gateway.settings import GatewaySettings
    from streams.settings import WorkerSettings

    return (Settings, GatewaySettings, WorkerSettings)


def _variable(cls: type[BaseSettings], field: str) -> str:
    return f"{cls.model_config.get('env_prefix', '')}{field}".upper()


def known_variables() -> set[str]:
    """Every ``TOKENFLEET_*`` variable something reads: each field of the settings classes
    under its class's prefix, and ``OTHER_VARIABLES``."""
    return set(OTHER_VARIABLES) | {
        _variable(cls, field) for cls in _settings_classes() for field in cls.model_fields
    }


def variable_of(settings_class: str, field: str) -> str:
    """The environment variable that sets ``field`` of the settings class of that name
    (``GatewaySettings``, ...); the field's own name for another class."""
    for cls in _settings_classes():
        if cls.__name__ == settings_class and field in cls.model_fields:
            return _variable(cls, field)
    return field


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A warning for each ``TOKENFLEET_*`` variable in ``environ`` that nothing reads (a
    misspelt one is silently ignored otherwise), naming the closest known one. The
    settings classes are read only where some such variable is set: every command starts
    here."""
    ours = [
        name
        for name in sorted(environ)
        if name.upper().startswith("TOKENFLEET_") and not name.upper().startswith(_IGNORED_PREFIX)
    ]
    if not ours:
        return []
    known = known_variables()
    warnings = []
    for name in ours:
        if name.upper() not in known:
            close = difflib.get_close_matches(name.upper(), known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            warnings.append(f"{name} is not a setting TokenFleet reads, ignored{hint}")
    return warnings
