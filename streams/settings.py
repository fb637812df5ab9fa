"""Settings of the table processors, from the environment (prefix ``TOKENFLEET_WORKER_``).

The Faust worker and the embedded host read the same ones.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from streams.tables.windows import WindowSpec


class WorkerSettings(BaseSettings):
    """From the environment, prefix ``TOKENFLEET_WORKER_``."""

    model_config = SettingsConfigDict(
        env_prefix="TOKENFLEET_WORKER_", frozen=True, allow_inf_nan=False
    )

    app_id: str = "tokenfleet-tables"
    """The consumer group; workers with one id share the partitions."""
    window_s: float = Field(default=60.0, gt=0)
    slide_s: float = Field(default=5.0, gt=0)
    grace_s: float = Field(default=10.0, ge=0)
    publish_s: float = Field(default=2.0, gt=0)
    """Seconds between table snapshots."""
    batch: int = Field(default=1000, ge=1)
    """Updates applied to the DC tables per write."""
    session_timeout_s: float = Field(default=10.0, ge=6, le=60)
    """How long the broker waits for a silent worker before its partitions move to the
    others (Kafka's ``session.timeout.ms``; heartbeats go every 3 s, or every third of it
    if that is less). Faust's own
    default, 60 s, left the tables unpublished for over a minute after a worker died:
    twice the 30 s after which the controllers stop acting on them. The broker's bounds
    (``group.min.session.timeout.ms``, 6 s by default) and Faust's (under its 90 s
    request timeout) limit it."""
    standby_replicas: int = Field(default=0, ge=0)
    """Copies of each table partition that other workers keep from its changelog (Faust's
    ``table_standby_replicas``, whose default is 1; Kafka Streams' ``num.standby.replicas``
    defaults to 0). With the in-memory store, which keeps no offsets, a worker that takes a
    partition over reads its changelog from the start whether it held a copy or not
    (Faust 0.15's recovery starts at the store's persisted offset), so a copy buys no
    faster hand-over, while each worker of a group reads the others' changelogs all the
    time: two workers with one copy spent 97 and 120 us of CPU an event, with none 78 to
    82, one worker alone 81 and 85 (the streams bench's bulk step, 90,000 events, two
    rounds each, by a script built on its helpers; 2-core machine)."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "WARNING"
    """The worker's log level. INFO shows Faust's rebalances and table recoveries, which
    are what to read when a restarted worker is slow to publish."""
    data_dir: Path = Path(tempfile.gettempdir()) / "tokenfleet-worker"
    """Faust's folder (it keeps tables in memory but still makes one), not the cwd."""

    @model_validator(mode="after")
    def _window_of_whole_slides(self) -> WorkerSettings:
        """The window's own checks, here: a command then names them as its settings'
        (``recount`` said a broker it had not asked refused them)."""
        try:
            self.spec  # noqa: B018
        except ValueError as exc:
            raise ValueError(
                f"TOKENFLEET_WORKER_WINDOW_S {self.window_s:g}, TOKENFLEET_WORKER_SLIDE_S "
                f"{self.slide_s:g}: {exc}"
            ) from None
        return self

    @property
    def spec(self) -> WindowSpec:
        return WindowSpec(self.window_s, self.slide_s, self.grace_s)
