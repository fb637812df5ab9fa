"""``tokenfleet audit``: the gateways' decision journals replayed, every decision made again
from the inputs recorded with it (``control.journal``), and each one that comes out
different reported.

A journal is read whole and in order: a pool's pipeline is rebuilt from its first record's
recipe (the same policies, parameters and seed the gateway built it with), and every call
is made again, so what its router learned is learned again from the same observations.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from control.admission.registry import make_admission
from control.fleet.journal import replay_dc_choice
from control.fleet.registry import make_dc_policy
from control.journal import START, Difference, Record, missing, replay
from control.pipeline import Pipeline
from control.routing import make_router, policy_params
from schemas import Envelope
from schemas.audit import JournalRecord
from schemas.envelope import DecodeError, decode
from tokenfleet.commands.errors import message_of
from tokenfleet.gateway_wiring import pool_model


@dataclass
class JournalAudit:
    journal: str
    records: int
    decisions: int = 0
    differences: list[Difference] = field(default_factory=list)
    problem: str | None = None

    @property
    def reproduced(self) -> bool:
        return self.problem is None and not self.differences


def journals_in(envelopes: Iterable[Envelope]) -> tuple[dict[str, list[Record]], int]:
    """Each journal's records, in their order, each once (a topic's partitions, or a file
    written by several gateways, interleave journals; a producer that retried after a
    broker failure may have written a record twice; a record keeps its number); and how
    many records had no number or no call (left out)."""
    journals: dict[str, dict[int, Record]] = defaultdict(dict)
    malformed = 0
    for envelope in envelopes:
        if isinstance(envelope.payload, JournalRecord):
            record = envelope.payload.record
            if not isinstance(record.get("seq"), int) or not isinstance(record.get("call"), str):
                malformed += 1
                continue
            journals[envelope.payload.journal].setdefault(record["seq"], record)
    return {name: [r[n] for n in sorted(r)] for name, r in journals.items()}, malformed


def read_file(path: Path) -> tuple[list[Envelope], int]:
    """The envelopes of a journal file (JSON lines), and how many lines were not one."""
    envelopes: list[Envelope] = []
    undecodable = 0
    with path.open("rb") as lines:
        for line in lines:
            if not line.strip():
                continue
            try:
                envelopes.append(decode(line))
            except DecodeError:
                undecodable += 1
    return envelopes, undecodable


def audit_journal(name: str, records: list[Record]) -> JournalAudit:
    """Replay one journal: a pool's pipeline, or a gateway's DC choices. A record that is
    not what the journal's format says ends the replay, as the problem."""
    result = JournalAudit(name, len(records))
    try:
        start = records[0] if records else None
        if start is not None and start["call"] == START and "dc_policy" in start["recipe"]:
            _replay_dc_choices(start["recipe"]["dc_policy"], records, result)
            return result
        replayed = replay(records, _pipeline)
    except (
        KeyError,
        TypeError,
        ValueError,
        IndexError,
        AttributeError,  # a null where a record's format has an object
        AssertionError,  # a call the rebuilt pipeline cannot make (another version's)
        OverflowError,  # a number past what a snapshot's arrays hold
    ) as exc:
        result.problem = f"a record is malformed ({type(exc).__name__}: {message_of(exc)})"
        return result
    result.decisions, result.differences = replayed.decisions, replayed.differences
    result.problem = replayed.problem
    return result


def _replay_dc_choices(dc_policy: str, records: list[Record], result: JournalAudit) -> None:
    """Each DC choice made again; a missing record is reported (the others still are
    checked: a DC choice depends on its own record alone)."""
    policy = make_dc_policy(dc_policy)
    for expected, record in enumerate(records[1:], start=1):
        if result.problem is None:
            result.problem = missing(expected, record)
        result.decisions += 1
        if (difference := replay_dc_choice(record, policy)) is not None:
            result.differences.append(difference)


def _pipeline(start: Record) -> Pipeline[str]:
    """A pool's pipeline as the gateway built it (``tokenfleet.gateway_wiring``)."""
    recipe = start["recipe"]
    pool = pool_model(recipe["profile"], recipe.get("max_num_seqs"))
    params = policy_params(recipe["policy"], recipe["params"])
    router = make_router(recipe["policy"], recipe["seed"], pool, params)
    return Pipeline(make_admission(recipe["admission"], pool), router)


class _Absent:
    """A field one of two results lacks."""

    def __repr__(self) -> str:
        return "(absent)"


ABSENT = _Absent()
"""What ``fields_that_differ`` gives for a field one of the results lacks."""


def fields_that_differ(
    recorded: object, replayed: object, at: str = ""
) -> Iterator[tuple[str, object, object]]:
    """Where a replayed result differs from the recorded one: each differing field's path
    (``route.scores[1]``) with its two values. A decision's whole result runs to kilobytes,
    and the field that differs may be anywhere in it."""
    if isinstance(recorded, dict) and isinstance(replayed, dict):
        keys = [*recorded, *(key for key in replayed if key not in recorded)]
        for key in keys:
            inner = f"{at}.{key}" if at else str(key)
            yield from fields_that_differ(
                recorded.get(key, ABSENT), replayed.get(key, ABSENT), inner
            )
    elif (
        isinstance(recorded, list) and isinstance(replayed, list) and len(recorded) == len(replayed)
    ):
        for n, (mine, theirs) in enumerate(zip(recorded, replayed, strict=True)):
            yield from fields_that_differ(mine, theirs, f"{at}[{n}]")
    elif recorded != replayed:
        yield at, recorded, replayed
