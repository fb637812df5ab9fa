"""The gateway's decision journal, for ``tokenfleet audit``: every call of its pipelines
(``control.journal.JournaledPipeline``) and every choice of DC, with their inputs, as
``tf.audit.journal`` records on the bus (``TOKENFLEET_GATEWAY_JOURNAL``) and as JSON lines
in a file (``TOKENFLEET_GATEWAY_JOURNAL_FILE``).

Each pool's pipeline writes a journal of its own, and the DC choices one more; a journal's
name says whose it is and which run of the gateway wrote it, so a restarted gateway starts
new journals (its pipelines start afresh too). On the bus the records travel with the
lifecycle events, through the same bounded buffer: a record dropped there shows as a gap
in its journal, which the audit reports.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from control.journal import START, Journal, Record
from schemas import Envelope, Message
from schemas.audit import JournalRecord
from schemas.envelope import encode

log = logging.getLogger(__name__)

DC_CHOICES = "dc-choices"
"""The pool part of the name of a gateway's journal of DC choices."""
NAME_LIMIT = 256
"""The longest journal name a ``JournalRecord`` carries."""


class Journals:
    def __init__(
        self,
        gateway: str,
        recipe: Callable[[str], Record],
        dc_policy: str,
        emit: Callable[[Message], None] | None = None,
        path: Path | None = None,
        on_lost: Callable[[], None] = lambda: None,
    ) -> None:
        """``recipe(model)``: how the gateway builds a pool's admission and router (policy
        names, parameters, seed, the model's profile); ``emit``: onto the bus; ``path``:
        the file, appended to; ``on_lost``: a record could not be kept (logged, and a gap
        in its journal for the audit: serving goes on)."""
        self.gateway = gateway
        self._recipe = recipe
        self._run = secrets.token_hex(4)
        self._emit = emit
        self._on_lost = on_lost
        self._file = None if path is None else _appended(path)
        self.dc_choice = self._numbered(self._writer(DC_CHOICES))
        self.dc_choice({"call": START, "recipe": {"dc_policy": dc_policy}})

    def pool(self, model: str, dc: str) -> tuple[Journal, Record]:
        """The journal for a new pipeline of ``model`` in ``dc``, and its recipe."""
        return self._writer(f"{model}@{dc}"), self._recipe(model)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def _writer(self, pool: str) -> Journal:
        name = _bounded(f"{self.gateway}/{pool}/{self._run}")

        def write(record: Record) -> None:
            try:
                message = JournalRecord(journal=name, record=record)
                if self._emit is not None:
                    self._emit(message)
                if self._file is not None:
                    line = encode(Envelope.wrap(message, source=self.gateway)).decode()
                    self._file.write(line + "\n")
            except Exception:  # the decision stands; the audit will see the gap
                log.exception("journal %s lost record %s", name, record.get("seq"))
                self._on_lost()

        return write

    @staticmethod
    def _numbered(write: Journal) -> Journal:
        """A journal whose records are numbered as they are written."""
        count = 0

        def numbered(record: Record) -> None:
            nonlocal count
            write({"seq": count} | record)
            count += 1

        return numbered


def _bounded(name: str) -> str:
    """``name``, or where it is too long for a record, its start and a digest of it."""
    if len(name) <= NAME_LIMIT:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    return f"{name[: NAME_LIMIT - 17]}~{digest}"


def _appended(path: Path) -> TextIO:
    """``path`` open to append to, line by line; ValueError naming the setting where it
    cannot be (the gateway's start said only the OS's error)."""
    try:
        return path.open("a", encoding="utf-8", buffering=1)
    except OSError as exc:
        raise ValueError(f"TOKENFLEET_GATEWAY_JOURNAL_FILE {path}: {exc.strerror}") from None
