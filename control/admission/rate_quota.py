"""The token-bucket side of ``tf.control.quotas``: which class quota a request draws on,
and what it takes. The bucket itself is the host's (the gateway keeps it in its shared
state, refilled on one clock for every replica)."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.base import TaskClass
from schemas.control import AdmissionQuotas, ClassQuota


@dataclass(frozen=True)
class BucketDraw:
    """What one request takes from which bucket."""

    bucket: str
    rate_per_s: float
    burst_tokens: float
    tokens: float


def quota_for(quotas: AdmissionQuotas, task_class: TaskClass, tenant: str) -> ClassQuota | None:
    """The tenant's own quota for the class, else the class-wide one."""
    fits = [q for q in quotas.quotas if q.task_class == task_class]
    return next((q for q in fits if q.tenant == tenant), None) or next(
        (q for q in fits if q.tenant is None), None
    )


def bucket_draw(
    quotas: AdmissionQuotas, dc: str, task_class: TaskClass, tenant: str, tokens: int
) -> BucketDraw | None:
    """What a request of ``tokens`` (prompt and output budget) takes in ``dc``, from the
    bucket of the quota it draws on; None when that quota sets no bucket. A request larger
    than the bucket takes all of it, so that it can pass at all; but a bucket of 0 holds
    nothing, and the whole request never fits in it: ``burst_tokens=0`` shuts the class or
    tenant off (it took 0 tokens of 0 and passed, whatever the rate)."""
    quota = quota_for(quotas, task_class, tenant)
    if quota is None or quota.tokens_per_s is None or quota.burst_tokens is None:
        return None
    burst = quota.burst_tokens
    bucket = f"{dc}:{quota.task_class.value}:{quota.tenant or '*'}"
    return BucketDraw(bucket, quota.tokens_per_s, burst, min(tokens, burst) if burst else tokens)
