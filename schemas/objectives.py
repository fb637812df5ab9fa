"""Service objectives per task class, and whether a finished request met its class's.

Defaults follow DESIGN.md (Measures); deployments override them in configuration.
"""

from __future__ import annotations

import math

from pydantic import Field

from schemas.base import Frozen, TaskClass


class ClassObjective(Frozen):
    ttft_s: float | None = Field(default=None, gt=0, description="Time to first token, at most.")
    tpot_s: float | None = Field(default=None, gt=0, description="Time per output token, at most.")
    use_deadline: bool = Field(default=False, description="Must finish by its own deadline.")

    def met(
        self,
        ttft_s: float,
        tpot_s: float,
        e2e_s: float,
        deadline_s: float | None,
        *,
        whole_output_tokens: int | None = None,
    ) -> bool:
        """Whether a completed request met this objective (a missing deadline is met).

        A whole (unstreamed) answer shows no first token, so its TTFT and TPOT cannot be
        measured: give ``whole_output_tokens``, and it is judged by its end instead, which
        must come by when a streamed answer meeting both bounds would have ended (TTFT
        bound, plus the TPOT bound for each token after the first)."""
        if whole_output_tokens is not None:
            latest = (self.ttft_s or math.inf) + (self.tpot_s or 0.0) * max(
                whole_output_tokens - 1, 0
            )
            if e2e_s > latest:
                return False
        else:
            if self.ttft_s is not None and ttft_s > self.ttft_s:
                return False
            if self.tpot_s is not None and tpot_s > self.tpot_s:
                return False
        return not (self.use_deadline and deadline_s is not None and e2e_s > deadline_s)


DEFAULT_OBJECTIVES: dict[TaskClass, ClassObjective] = {
    TaskClass.INTERACTIVE: ClassObjective(ttft_s=2.0, tpot_s=0.1),
    TaskClass.LONG_DOCUMENT: ClassObjective(ttft_s=30.0),
    TaskClass.BATCH: ClassObjective(use_deadline=True),
}


class Objectives(Frozen):
    """The objectives requests are held to: each class's, and a tenant's own where its
    entry in the fleet file overrides one."""

    classes: dict[TaskClass, ClassObjective] = Field(
        default_factory=lambda: dict(DEFAULT_OBJECTIVES)
    )
    tenants: dict[str, dict[TaskClass, ClassObjective]] = Field(default_factory=dict)

    def of(self, task_class: TaskClass, tenant: str | None = None) -> ClassObjective:
        """The objective a request of ``task_class`` from ``tenant`` is held to."""
        own = self.tenants.get(tenant, {}) if tenant is not None else {}
        return own.get(task_class) or self.classes[task_class]
