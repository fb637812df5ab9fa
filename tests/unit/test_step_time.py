from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from control.step_time import Blackbox, KneeRoofline, StepTime
from sim.profiles import profile

MODELS: dict[str, StepTime] = {
    "knee roofline": profile("llama3-70b-4xh100").pool_model().step_time,
    "blackbox": Blackbox(6_910.4, 17.67, 2.84, 1_000.0, 0.5, 500.0),
}

loads = st.lists(
    st.tuples(
        st.integers(0, 40_000),  # prefill tokens
        st.integers(0, 10**8),  # prefill attention pairs
        st.integers(0, 512),  # decoding sequences
        st.integers(0, 2_000_000),  # their context
    ),
    min_size=1,
    max_size=16,
)


@settings(max_examples=100, deadline=None)
@given(loads, st.sampled_from(sorted(MODELS)))
def test_steps_under_load_time_each_instance_as_the_scalar_model_does(
    instances: list[tuple[int, int, int, int]], name: str
) -> None:
    """Routers time many instances at once through ``under_load``; the engine, one step at
    a time through ``step_s``. Both must be the same model."""
    model = MODELS[name]
    prefill, pairs, seqs, context = (np.array(column) for column in zip(*instances, strict=True))
    vectorised = model.under_load(seqs, context).step_s(prefill) + model.attention_s(pairs)
    one_by_one = [model.step_s(*instance) for instance in instances]
    np.testing.assert_allclose(vectorised, one_by_one, rtol=1e-12)


@settings(max_examples=100, deadline=None)
@given(loads, st.integers(0, 4), st.sampled_from(sorted(MODELS)))
def test_a_decoding_step_with_more_sequences_is_the_load_with_them(
    instances: list[tuple[int, int, int, int]], more: int, name: str
) -> None:
    """``decode_step_s`` prices a request joining the decoding batch without binding the
    model to a second load."""
    model = MODELS[name]
    _, _, seqs, context = (np.array(column) for column in zip(*instances, strict=True))
    np.testing.assert_allclose(
        model.under_load(seqs, context).decode_step_s(more),
        model.under_load(seqs + more, context).step_s(0),
        rtol=1e-12,
    )


def test_a_scalar_load_stands_for_every_instance() -> None:
    model = MODELS["knee roofline"]
    assert isinstance(model, KneeRoofline)
    prefill = np.array([0, 100, 8_000])
    np.testing.assert_allclose(
        model.under_load(0, 0).step_s(prefill),
        [model.step_s(int(tokens), 0, 0, 0) for tokens in prefill],
        rtol=1e-12,
    )
