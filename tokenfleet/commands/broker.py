"""Which Kafka broker a command talks to, and whether the Redis it is given answers."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from schemas import TOPICS, Topic
from tokenfleet.commands.errors import CliError
from tokenfleet.deployment import DEFAULT_HOME, Deployment
from tokenfleet.services.kafka import running_bootstrap
from tokenfleet.settings import Settings


def broker(home: Path = DEFAULT_HOME) -> str:
    """``TOKENFLEET_KAFKA_BOOTSTRAP``; else the broker of the deployment ``tokenfleet up``
    recorded in ``home`` (read only when the variable is unset; its own broker only while
    that runs); else the local broker of ``tokenfleet kafka start``."""
    address = Settings().kafka_bootstrap or Deployment(home).kafka_bootstrap()
    address = address or running_bootstrap()
    if address is None:
        raise CliError(
            "no Kafka broker: set TOKENFLEET_KAFKA_BOOTSTRAP, or start one with "
            "'tokenfleet up' or 'tokenfleet kafka start'"
        )
    return address


def create_topics_on(
    bootstrap: str, topics: Sequence[Topic] = TOPICS, replication: int | None = None
) -> list[str]:
    """Create the ``topics`` the broker lacks (the names it created), with ``replication``
    copies (``TOKENFLEET_KAFKA_REPLICATION`` where None); CliError where the broker cannot
    be reached, ``bootstrap`` is no broker address, or a topic exists with another number
    of partitions."""
    from streams.kafka import PartitionsMismatch, create_topics

    copies = Settings().kafka_replication if replication is None else replication
    try:
        return asyncio.run(create_topics(bootstrap, topics, copies))
    except PartitionsMismatch as exc:
        raise CliError(str(exc)) from None
    except Exception as exc:
        raise CliError(
            f"cannot create the topics on the Kafka broker at {bootstrap}: {exc!r}"
        ) from None


def check_redis(url: str, timeout_s: float = 2.0) -> None:
    """CliError where the Redis ``TOKENFLEET_REDIS_URL`` names is no Redis URL or does not
    answer a PING: ``up``'s gateways would each start on its own state, their ceilings,
    shares and idempotency keys unshared, saying so in their logs only; ``bench
    gateway`` met it with a traceback once its other measurements had run."""
    from redis import Redis, RedisError

    from gateway.redis_state import without_password

    try:
        client = Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    except ValueError as exc:
        raise CliError(f"TOKENFLEET_REDIS_URL: {exc}") from None
    try:
        client.ping()
    except (RedisError, OSError) as exc:
        raise CliError(
            f"Redis at {without_password(url)} does not answer, or refuses: {exc}"
        ) from None
    finally:
        client.close()
