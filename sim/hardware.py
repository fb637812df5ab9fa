"""Model shapes and accelerators: what KV capacity and the physics-derived step terms
follow from. Peak figures and MFUs are BLIS's (inference-sim ``hardware_config.json``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from sim.engine import EngineConfig
from sim.workload import ENGINE_BLOCK_TOKENS


@dataclass(frozen=True)
class Hardware:
    name: str
    tflops: float
    bandwidth_tbs: float
    mfu_prefill: float
    memory_gib: float


H100 = Hardware("H100-SXM", tflops=989.5, bandwidth_tbs=3.35, mfu_prefill=0.45, memory_gib=80)


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    params_b: float
    active_params_b: float

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    def physics(self, hardware: Hardware, tp: int) -> dict[str, float]:
        """The coefficients that come from peak figures, not from the fit."""
        flops = tp * hardware.tflops * 1e12 * hardware.mfu_prefill
        bandwidth = tp * hardware.bandwidth_tbs * 1e12
        weight_read_s = self.params_b * 1e9 * 2 / bandwidth
        per_token_s = 2 * self.active_params_b * 1e9 / flops
        return {
            "d_s_per_context_token": self.kv_bytes_per_token / bandwidth,
            "e_s_per_prefill_pair": 4 * self.layers * self.hidden / flops,
            "n0_tokens": weight_read_s / per_token_s,
        }


def engine_for(shape: ModelShape, hardware: Hardware, tp: int, max_model_len: int) -> EngineConfig:
    """KV capacity: 90 % of memory, less weights and 4 GiB of activations per GPU."""
    free = tp * hardware.memory_gib * 0.9 - shape.params_b * 2 * 1e9 / 2**30 - 4 * tp
    blocks = math.floor(free * 2**30 / (shape.kv_bytes_per_token * ENGINE_BLOCK_TOKENS))
    return EngineConfig(num_blocks=blocks, max_model_len=max_model_len)
