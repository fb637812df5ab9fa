"""What a simulated cluster is made of: instance profiles, data centers, the network."""

from __future__ import annotations

from dataclasses import dataclass, field

from control.routing import PoolModel
from control.step_time import StepTime
from sim.engine import EngineConfig


@dataclass(frozen=True)
class InstanceProfile:
    """A model served on some hardware: engine limits and step times."""

    name: str
    model: str
    hardware: str
    engine: EngineConfig
    step_time: StepTime
    notes: str = ""

    def pool_model(self) -> PoolModel:
        """What routers may know of a pool of these instances."""
        return PoolModel(self.step_time, self.engine.block_size, self.engine.max_num_batched_tokens)


@dataclass(frozen=True)
class DataCenter:
    name: str
    instances: int
    profile: InstanceProfile


@dataclass(frozen=True)
class Cluster:
    """Data centers and the round-trip time between regions (seconds; symmetric).

    A request from a region that is not the executing DC's pays one RTT on its time to
    first token; regions missing from ``rtt_s`` are treated as local (0).
    """

    data_centers: tuple[DataCenter, ...]
    rtt_s: dict[tuple[str, str], float] = field(default_factory=dict)

    def rtt(self, region: str, dc: str) -> float:
        if region == dc:
            return 0.0
        return self.rtt_s.get((region, dc), self.rtt_s.get((dc, region), 0.0))

    @classmethod
    def single(cls, profile: InstanceProfile, instances: int, dc: str = "local") -> Cluster:
        return cls((DataCenter(dc, instances, profile),))
