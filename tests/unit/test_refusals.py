"""How the gateway answers admission's refusals (``gateway/refusals.py``)."""

from __future__ import annotations

from control.admission.request import AdmissionRequest
from control.admission.view import EXPIRED, MAX_HOLD, AdmissionDecision, Verdict
from control.pipeline import Outcome
from gateway.refusals import Refused, refusal
from schemas.base import TaskClass
from schemas.lifecycle import RejectReason


def refused(reason: str, *, waited: bool) -> Refused:
    request = AdmissionRequest("r", TaskClass.BATCH, "t", 1_000, 100, 0.0)
    answer = refusal(
        Outcome(request, None, AdmissionDecision(Verdict.REJECT, reason)), waited=waited
    )
    assert isinstance(answer, Refused)
    return answer


def test_a_hold_that_ran_out_of_its_objective_is_a_deadline_missed() -> None:
    answer = refused(EXPIRED, waited=True)
    assert (answer.status, answer.reason, answer.retry_after_s) == (
        503,
        RejectReason.DEADLINE,
        None,
    )
    assert "can no longer meet its objective" in answer.message


def test_a_request_held_the_longest_its_policy_holds_one_is_refused_for_want_of_capacity() -> None:
    """SLOMax's longest hold of a request without an objective, llm-d flow control's TTL:
    no objective was missed, and the event must not count it among the missed ones."""
    answer = refused(MAX_HOLD, waited=True)
    assert (answer.status, answer.reason, answer.retry_after_s) == (
        503,
        RejectReason.NO_CAPACITY,
        None,
    )
    assert "objective" not in answer.message
    assert "(max_hold)" in answer.message  # the reason, as every refusal's message names it
