"""Settings of the table processors, from the environment (prefix ``TOKENFLEET_WORKER_``).

The Faust worker and the embedded host read the same ones.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from streams.tables.windows import WindowSpec


class WorkerSettings(BaseSettings):
    """From the environment, prefix ``TOKENFLEET_WORKER_``."""

    model_config = SettingsConfigDict(env_prefix="TOKENFLEET_WORKER_", frozen=True)

    app_id: str = "tokenfleet-tables"
    """The consumer group; workers with one id share the partitions."""
    window_s: float = Field(default=60.0, gt=0)
    slide_s: float = Field(default=5.0, gt=0)
    grace_s: float = Field(default=10.0, ge=0)
    publish_s: float = Field(default=2.0, gt=0)
    """Seconds between table snapshots."""
    batch: int = Field(default=1000, ge=1)
    """Updates applied to the DC tables per write."""
    data_dir: Path = Path(tempfile.gettempdir()) / "tokenfleet-worker"
    """Faust's folder (it keeps tables in memory but still makes one), not the cwd."""

    @property
    def spec(self) -> WindowSpec:
        return WindowSpec(self.window_s, self.slide_s, self.grace_s)
