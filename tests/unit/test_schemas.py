from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import MESSAGES, DecodeError, Envelope, Message, decode, encode
from schemas.control import AdmissionQuotas, ClassQuota, DcWeight
from schemas.lifecycle import CandidateScore, RequestArrived, RequestRouted
from schemas.telemetry import InstanceTelemetry
from tests.strategies import models


def _envelopes(message: type[Message]) -> st.SearchStrategy[Envelope]:
    return st.builds(
        lambda payload, ts, source: Envelope.wrap(payload, source=source, ts=ts),
        models(message),
        st.floats(0, 4e9, allow_nan=False),
        st.text(min_size=1, max_size=16),
    )


@pytest.mark.parametrize("ref", sorted(MESSAGES))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(data=st.data())
def test_every_message_round_trips_through_the_codec(ref: str, data: st.DataObject) -> None:
    envelope = data.draw(_envelopes(MESSAGES[ref]))
    decoded = decode(encode(envelope))
    assert decoded == envelope
    assert type(decoded.payload) is MESSAGES[ref]


def _routed() -> Envelope:
    payload = RequestRouted(
        request_id="r-1",
        dc="dc-a",
        instance_id="i-1",
        policy="tokenpilot",
        candidates=(CandidateScore(instance_id="i-1", score=0.25, parts={"queue_s": 0.1}),),
    )
    return Envelope.wrap(payload, source="gateway-a", ts=1.0, event_id="e-1")


def _mutated(**changes: object) -> bytes:
    raw = json.loads(encode(_routed()))
    for path, value in changes.items():
        target = raw
        *parents, leaf = path.split("__")
        for part in parents:
            target = target[int(part)] if part.isdigit() else target[part]
        if value is KeyError:
            del target[leaf]
        else:
            target[leaf] = value
    return json.dumps(raw).encode()


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "must be a JSON object, got list"),
        (_mutated(schema="tf.request.routed/9"), "unknown schema 'tf.request.routed/9'"),
        (_mutated(schema=KeyError), "unknown schema None"),
        (_mutated(payload__instance_id=KeyError), "payload.instance_id: Field required"),
        (_mutated(payload__candidates__0__score="high"), "payload.candidates.0.score"),
        (_mutated(payload__surprise=1), "payload.surprise: Extra inputs are not permitted"),
        (_mutated(event_id=""), "event_id: String should have at least 1 character"),
        (_mutated(ts="yesterday"), "ts: Input should be a valid number"),
    ],
)
def test_malformed_input_is_rejected_with_field_and_reason(data: bytes, expected: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode(data)
    assert expected in str(info.value)


def test_a_non_finite_number_is_rejected() -> None:
    data = encode(_routed()).replace(b'"score":0.25', b'"score":NaN')
    with pytest.raises(DecodeError, match=r"payload\.candidates\.0\.score"):
        decode(data)


def test_models_are_frozen() -> None:
    arrived = RequestArrived(
        request_id="r",
        tenant="t",
        task_class="interactive",
        model="m",
        input_tokens=10,
        output_budget=5,
        source_region="eu",
    )
    with pytest.raises(ValueError, match="frozen"):
        arrived.input_tokens = 11  # type: ignore[misc]


def test_cross_field_rules_name_the_fields() -> None:
    with pytest.raises(ValueError, match=r"kv_blocks_used \(9\) exceeds kv_blocks_total \(8\)"):
        InstanceTelemetry(
            instance_id="i",
            dc="d",
            model="m",
            model_version="1",
            ready=True,
            waiting=0,
            running=0,
            inflight_tokens=0,
            kv_blocks_used=9,
            kv_blocks_total=8,
        )
    quota = ClassQuota(
        task_class="batch", tokens_per_s=1, burst_tokens=1, max_concurrency=1, reserved_share=0.6
    )
    with pytest.raises(ValueError, match=r"reserved shares add up to 1\.200"):
        AdmissionQuotas(scope="dc", version=1, issued_at=0, ttl_s=5, quotas=(quota, quota))


def test_a_dc_weight_is_a_share_of_its_capacity() -> None:
    """A weight past 1 would count a DC beyond its capacity: refused, as a negative one."""
    assert DcWeight(model="m", dc="d", weight=1.0).weight == 1.0
    for wrong in (5.0, -0.1):
        with pytest.raises(ValueError, match="weight"):
            DcWeight(model="m", dc="d", weight=wrong)


def test_a_quota_without_a_reserve_leaves_it_off_the_wire_and_counts_none() -> None:
    """Unset, the reserve is not written: readers of an earlier version, which take a
    missing reserve as 0.0, read the controller's quotas as they did before."""
    bucket = ClassQuota(task_class="interactive", tokens_per_s=1, burst_tokens=1)
    held = ClassQuota(task_class="batch", reserved_share=1.0)
    quotas = AdmissionQuotas(scope="dc", version=1, issued_at=0, ttl_s=5, quotas=(bucket, held))
    written = json.loads(encode(Envelope.wrap(quotas, source="c")))["payload"]["quotas"]
    assert "reserved_share" not in written[0]
    assert written[1]["reserved_share"] == 1.0
    decoded = decode(encode(Envelope.wrap(quotas, source="c"))).payload
    assert decoded == quotas
    assert isinstance(decoded, AdmissionQuotas)
    assert decoded.quotas[0].reserved_share is None


def test_a_snapshot_supersedes_only_older_versions() -> None:
    def quotas(version: int) -> AdmissionQuotas:
        return AdmissionQuotas(scope="dc", version=version, issued_at=0, ttl_s=5, quotas=())

    assert quotas(1).supersedes(None)
    assert quotas(2).supersedes(quotas(1))
    assert not quotas(2).supersedes(quotas(2))
    assert not quotas(1).supersedes(quotas(2))
    assert quotas(1).expired(now=5.1)
    assert not quotas(1).expired(now=5.0)
