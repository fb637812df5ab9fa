"""Whom an instance's 4xx answer blames (``gateway.upstream_answers.blame``)."""

import json

import pytest

from gateway.upstream_answers import ERROR_TEXT_CHARS, Blame, blame, message_of


def _error(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "code": 404}}).encode()


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (400, _error("This model's maximum context length is 8192 tokens."), Blame.REQUEST),
        (413, b"", Blame.REQUEST),
        (422, b"{}", Blame.REQUEST),
        (404, _error("Response with id 'resp_1' not found."), Blame.REQUEST),
        # a client's own id carrying the sentence is still the request's 404
        (404, _error("Response `The model `m` does not exist.` not found."), Blame.REQUEST),
        (404, _error("The model `m` does not exist."), Blame.INSTANCE),
        (404, _error("The model `other` does not exist."), Blame.REQUEST),
        (401, _error("Invalid API key."), Blame.DC),
        (429, b"slow down", Blame.DC),
    ],
)
def test_blame(status: int, body: bytes, expected: Blame) -> None:
    assert blame(status, body, "m")[0] is expected


def test_an_instance_blamed_names_what_it_said() -> None:
    assert blame(404, _error("The model `m` does not exist."), "m") == (
        Blame.INSTANCE,
        "The model `m` does not exist.",
    )


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (_error("bad"), "bad"),
        (b'{"object": "error", "message": "older", "code": 400}', "older"),
        (b"  plain text \n", "plain text"),
        (b"x" * 1000, "x" * ERROR_TEXT_CHARS),
    ],
)
def test_message_of_reads_each_shape_vllm_answers(body: bytes, expected: str) -> None:
    assert message_of(body) == expected
