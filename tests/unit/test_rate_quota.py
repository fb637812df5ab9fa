"""The token-bucket side of the quotas: which quota a request draws on, and how much."""

from __future__ import annotations

from control.admission.rate_quota import BucketDraw, bucket_draw, quota_for
from schemas.base import TaskClass
from schemas.control import AdmissionQuotas, ClassQuota

BATCH = TaskClass.BATCH
QUOTAS = AdmissionQuotas(
    scope="dc-a",
    version=1,
    issued_at=0.0,
    ttl_s=60.0,
    quotas=(
        ClassQuota(task_class=BATCH, tokens_per_s=100.0, burst_tokens=1_000),
        ClassQuota(task_class=BATCH, tenant="acme", tokens_per_s=10.0, burst_tokens=50),
        ClassQuota(task_class=TaskClass.LONG_DOCUMENT, max_concurrency=4),
    ),
)


def test_a_tenant_draws_on_its_own_quota_else_on_its_class_s() -> None:
    assert quota_for(QUOTAS, BATCH, "acme") == QUOTAS.quotas[1]
    assert quota_for(QUOTAS, BATCH, "someone") == QUOTAS.quotas[0]
    assert quota_for(QUOTAS, TaskClass.INTERACTIVE, "acme") is None


def test_a_draw_names_its_bucket_per_dc_class_and_tenant() -> None:
    assert bucket_draw(QUOTAS, "dc-a", BATCH, "someone", 300) == BucketDraw(
        "dc-a:batch:*", 100.0, 1_000, 300
    )
    assert bucket_draw(QUOTAS, "dc-b", BATCH, "acme", 30) == BucketDraw(
        "dc-b:batch:acme", 10.0, 50, 30
    )


def test_a_request_larger_than_its_bucket_takes_all_of_it() -> None:
    draw = bucket_draw(QUOTAS, "dc-a", BATCH, "acme", 5_000)
    assert draw is not None
    assert draw.tokens == 50  # else it could never pass


def test_a_quota_without_a_bucket_draws_nothing() -> None:
    assert bucket_draw(QUOTAS, "dc-a", TaskClass.LONG_DOCUMENT, "acme", 10) is None
    assert bucket_draw(QUOTAS, "dc-a", TaskClass.INTERACTIVE, "acme", 10) is None


def test_a_bucket_of_nothing_draws_the_whole_request_which_never_fits() -> None:
    """A burst of 0 drew 0 tokens and passed: tokens_per_s=0, burst_tokens=0 let all in."""
    shut = ClassQuota(task_class=BATCH, tenant="acme", tokens_per_s=0.0, burst_tokens=0)
    quotas = QUOTAS.model_copy(update={"quotas": (shut,)})
    draw = bucket_draw(quotas, "dc-a", BATCH, "acme", 30)
    assert draw == BucketDraw("dc-a:batch:acme", 0.0, 0, 30)
