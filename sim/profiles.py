"""Named instance profiles: a model on some hardware, with its KV capacity and step times.

KV capacity: ``(TP x GPU memory x 0.9 - weights - 4 GiB activations per GPU)`` divided by
the KV bytes per token ``2 x layers x kv_heads x head_dim x 2 bytes`` (fp16/bf16), in
blocks of 16 tokens. Step-time coefficients: see ``sim/calibration.py`` and
``docs/validation.md`` for how they were fitted and how well they match measurements.
"""

from __future__ import annotations

from sim.cluster import InstanceProfile
from sim.engine import EngineConfig
from sim.step_time import KneeRoofline

GIB = 1024**3


def kv_blocks(
    *, gpus: int, gpu_gib: float, weights_gib: float, layers: int, kv_heads: int,
    head_dim: int, block_size: int = 16, utilisation: float = 0.9,
) -> int:  # fmt: skip
    free_bytes = (gpus * gpu_gib * utilisation - weights_gib - 4 * gpus) * GIB
    per_token = 2 * layers * kv_heads * head_dim * 2
    return int(free_bytes // (per_token * block_size))


LLAMA_70B_4XH100 = InstanceProfile(
    name="llama3-70b-4xh100",
    model="meta-llama/Llama-3.1-70B-Instruct",
    hardware="4 x H100-SXM 80 GB, TP4",
    engine=EngineConfig(
        num_blocks=kv_blocks(
            gpus=4, gpu_gib=80, weights_gib=131.4, layers=80, kv_heads=8, head_dim=128
        ),
        max_num_batched_tokens=8192,
        max_num_seqs=256,
        max_model_len=131072,
    ),
    step_time=KneeRoofline(
        a_s=0.016,
        b_s_per_token=55e-6,
        n0_tokens=250,
        c_s_per_seq=5e-6,
        d_s_per_context_token=0.04e-6,
        ttft_overhead_s=0.010,
    ),
    notes="Llama-3.1-70B shares Llama-2-70B's shape (80 layers, GQA 8 x 128, d 8192).",
)

PROFILES: dict[str, InstanceProfile] = {p.name: p for p in (LLAMA_70B_4XH100,)}


def profile(name: str) -> InstanceProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}") from None
