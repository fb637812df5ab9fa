"""How a request's upstream call fails: one instance (``UpstreamFailed``), or every instance
tried in a DC (``DcFailed``), the error the edge may pass on to the next DC."""

from __future__ import annotations

from schemas.openai_api import ApiError

CLIENT_LEFT = 499
"""The status of a request whose client went away before its answer (nginx's), logged and
counted; nobody reads it."""


class UpstreamFailed(Exception):
    """The instance could not serve the request (before any token reached the client).
    ``answered``: it had answered 2xx, and the whole answer it generated could not be read
    (the request ran). ``status``: the 5xx or 404 it answered (or the 5xx reported in its
    stream before any token); None where the call got no readable answer."""

    def __init__(self, error: str, *, answered: bool = False, status: int | None = None) -> None:
        super().__init__(error)
        self.answered = answered
        self.status = status


class DcFailed(ApiError):
    """Every instance tried in a DC failed the request before its first token: the edge
    may try another DC (nothing reached the client yet). ``answered``: one of them had
    generated a whole answer that could not be read (the request ran, and used the
    fleet)."""

    def __init__(self, error: str, instance_id: str, dc: str, *, answered: bool = False) -> None:
        super().__init__(502, f"The model instance failed: {error}")
        self.error = error
        self.instance_id = instance_id
        self.dc = dc
        self.answered = answered
