"""A pipeline's journal, and the audit that replays it.

A decision is reproducible from the log alone when the log holds everything that shaped
it: the snapshot and request it was made on, and everything the pipeline learned before
(every first token, end and observation its router learned from, every quota, peer
load and slot grant it was given). ``JournaledPipeline`` records each of those calls, in
order, as JSON records; ``replay`` builds the same pipeline afresh from the journal's
first record, makes the same calls and reports every decision that comes out different
(``tokenfleet audit``). Nothing but the calls is recorded: the router's and admission's
state is rebuilt by replaying what built it, so a router that learns needs no hook of
its own.

The record codec is ``records``, the pipeline that writes the journal ``writer`` and the
audit ``replay``; the names the rest of the code imports are here.
"""

from control.journal.records import Record, json_number
from control.journal.replay import Difference, missing, replay
from control.journal.writer import (
    PART,
    PART_BYTES,
    SAME_AS_LAST_PASS,
    START,
    Journal,
    JournaledPipeline,
)

__all__ = [
    "PART",
    "PART_BYTES",
    "SAME_AS_LAST_PASS",
    "START",
    "Difference",
    "Journal",
    "JournaledPipeline",
    "Record",
    "json_number",
    "missing",
    "replay",
]
