"""What a simulated cluster is made of: instance profiles, data centers, the network."""

from __future__ import annotations

from dataclasses import dataclass, field

from control.routing import PoolModel
from control.step_time import StepTime
from control.tokens import BYTES_PER_TOKEN
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
        engine = self.engine
        return PoolModel(
            self.step_time,
            max_num_batched_tokens=engine.max_num_batched_tokens,
            max_num_seqs=engine.max_num_seqs,
        )


@dataclass(frozen=True)
class DataCenter:
    name: str
    instances: int
    profile: InstanceProfile
    standby: int = 0
    """GPUs for more replicas, idle (not ready) until a replica is placed on them."""


@dataclass(frozen=True)
class Cluster:
    """Data centers and the round-trip time between a client's region and a DC (seconds;
    symmetric).

    A request from a region that is not the executing DC's pays one RTT on its time to
    first token, and its prompt's transfer at ``transfer_bytes_per_s``; regions missing
    from ``rtt_s`` are treated as local (0).
    """

    data_centers: tuple[DataCenter, ...]
    rtt_s: dict[tuple[str, str], float] = field(default_factory=dict)
    transfer_bytes_per_s: float = 12.5e6
    """100 Mbit/s per request's prompt, FleetMind's assumption (``FleetMindParams``)."""

    def rtt(self, region: str, dc: str) -> float:
        if region == dc:
            return 0.0
        return self.rtt_s.get((region, dc), self.rtt_s.get((dc, region), 0.0))

    def network_s(self, region: str, dc: str, input_tokens: int) -> float:
        """What the network adds to a request's first token: the round trip, and the
        prompt's transfer where the DC is remote."""
        rtt = self.rtt(region, dc)
        if rtt == 0:
            return 0.0
        return rtt + input_tokens * BYTES_PER_TOKEN / self.transfer_bytes_per_s

    @classmethod
    def single(cls, profile: InstanceProfile, instances: int, dc: str = "local") -> Cluster:
        return cls((DataCenter(dc, instances, profile),))
