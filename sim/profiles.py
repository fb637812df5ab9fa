"""Named instance profiles: a model on some hardware, its KV capacity and its step times.

Each profile names the measured model its step times were fitted to, and which of that
model's stages were used for the fit (the rest are held out). ``tokenfleet calibrate
--profile NAME`` refits and prints the validation table; ``docs/validation.md`` holds the
table for the coefficients below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from control.step_time import KneeRoofline
from sim.cluster import InstanceProfile
from sim.hardware import H100, Hardware, ModelShape, engine_for

if TYPE_CHECKING:
    from schemas.fleet import FleetConfig

TRAINING_STAGES = ("general/stage_0", "general/stage_1", "codegen/stage_0")
"""Fitted on the general workload's two rates and codegen's lower one; the rest held out."""


@dataclass(frozen=True)
class Calibrated:
    profile: InstanceProfile
    shape: ModelShape
    hardware: Hardware
    tp: int
    measured_model: str
    """Substring of the ground-truth experiment names this profile was fitted to."""


def _profile(
    name: str,
    model: str,
    shape: ModelShape,
    tp: int,
    max_model_len: int,
    measured: str,
    fitted: dict[str, float],
    notes: str = "",
) -> Calibrated:
    step_time = KneeRoofline(**{**shape.physics(H100, tp), **fitted})
    engine = engine_for(shape, H100, tp, max_model_len)
    hardware = f"{tp} x {H100.name} {H100.memory_gib:.0f} GB, TP{tp}"
    return Calibrated(
        InstanceProfile(name, model, hardware, engine, step_time, notes), shape, H100, tp, measured
    )


LLAMA_70B = ModelShape(
    "llama-70b",
    layers=80,
    hidden=8192,
    kv_heads=8,
    head_dim=128,
    params_b=69.0,
    active_params_b=69.0,
)
MIXTRAL_8X7B = ModelShape(
    "mixtral-8x7b",
    layers=32,
    hidden=4096,
    kv_heads=8,
    head_dim=128,
    params_b=46.7,
    active_params_b=12.9,
)
CODELLAMA_34B = ModelShape(
    "codellama-34b",
    layers=48,
    hidden=8192,
    kv_heads=8,
    head_dim=128,
    params_b=33.7,
    active_params_b=33.7,
)

CALIBRATED: dict[str, Calibrated] = {
    c.profile.name: c
    for c in (
        _profile(
            "llama3-70b-4xh100",
            "meta-llama/Llama-3.1-70B-Instruct",
            LLAMA_70B,
            4,
            131072,
            "llama-2-70b",
            {
                "a_s": 0.016282958614791405,
                "b_s_per_token": 1.9822185402068604e-05,
                "n0_tokens": 147.67551825331415,
                "c_s_per_seq": 6.705673880214157e-06,
                "ttft_overhead_s": 0.027950870729396306,
            },
            "Fitted to Llama-2-70B TP4, which has Llama-3.1-70B's shape (80 layers, GQA 8x128).",
        ),
        _profile(
            "mixtral-8x7b-2xh100",
            "mistralai/Mixtral-8x7B-v0.1",
            MIXTRAL_8X7B,
            2,
            32768,
            "mixtral-8x7b",
            {
                "a_s": 0.01793815222563903,
                "b_s_per_token": 6.149438866484869e-06,
                "n0_tokens": 534.9721203136835,
                "c_s_per_seq": 1.4863586106973654e-05,
                "ttft_overhead_s": 0.03628623609941213,
            },
            "Mixture of experts: 46.7 B weights, 12.9 B active per token.",
        ),
        _profile(
            "codellama-34b-2xh100",
            "codellama/CodeLlama-34b-hf",
            CODELLAMA_34B,
            2,
            16384,
            "codellama-34b",
            {
                "a_s": 0.013499448623437217,
                "b_s_per_token": 6.612091759918021e-06,
                "n0_tokens": 139.96877135890642,
                "c_s_per_seq": 9.827546022186532e-06,
                "ttft_overhead_s": 0.022324381691866093,
            },
        ),
    )
}

DEFAULT_PROFILE = "llama3-70b-4xh100"
"""The profile an instance is modelled by where none is named: the fleets' 70B on four H100s."""

PROFILES: dict[str, InstanceProfile] = {name: c.profile for name, c in CALIBRATED.items()}


def profile(name: str) -> InstanceProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}") from None


def check_fleet_profiles(fleet: FleetConfig) -> None:
    """ValueError naming a model of the fleet file whose ``profile`` is none of these (the
    fleet file's schema cannot know them): the gateway, the emulator and ``up`` refuse it
    before they start anything."""
    for model in fleet.models:
        if model.profile is not None and model.profile not in PROFILES:
            known = ", ".join(sorted(PROFILES))
            raise ValueError(f"model {model.name!r}: unknown profile {model.profile!r}; {known}")
