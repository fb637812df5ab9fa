"""The lean Redis client's reading of replies: whole ones, ones split anywhere, nested
ones, errors and nils."""

from __future__ import annotations

import numpy as np
import pytest
from redis.exceptions import AuthenticationError, NoScriptError, ResponseError

from gateway.redis_state import RedisState, refuses_for_good
from gateway.resp import _encoded, _Incomplete, _parsed

REPLIES = b"+OK\r\n:42\r\n$5\r\nhello\r\n$-1\r\n*3\r\n$1\r\na\r\n*1\r\n:7\r\n*0\r\n-ERR bad\r\n"


def test_replies_read_one_after_another() -> None:
    position, values = 0, []
    while position < len(REPLIES):
        value, position = _parsed(REPLIES, position)
        values.append(value)
    assert values[:5] == [b"OK", 42, b"hello", None, [b"a", [7], []]]
    assert isinstance(values[5], ResponseError)
    assert str(values[5]) == "ERR bad"


@pytest.mark.parametrize("cut", range(1, len(REPLIES)))
def test_a_reply_cut_anywhere_waits_for_the_rest(cut: int) -> None:
    """Whatever the network splits, a reply is read only once it is whole."""
    position, whole = 0, 0
    while True:
        try:
            _, position = _parsed(REPLIES[:cut], position)
        except _Incomplete:
            break
        whole += 1
    ends = [5, 10, 21, 26, 49, 59]  # where each reply ends
    assert whole == sum(end <= cut for end in ends)
    assert ends[-1] == len(REPLIES)


def test_a_missing_script_is_told_apart_from_other_errors() -> None:
    error, _ = _parsed(b"-NOSCRIPT No matching script.\r\n", 0)
    assert isinstance(error, NoScriptError)


def test_arguments_go_as_bulk_strings_floats_as_python_writes_them() -> None:
    assert _encoded(["EVALSHA", b"\x00", 2, -0.5]) == (
        b"*4\r\n$7\r\nEVALSHA\r\n$1\r\n\x00\r\n$1\r\n2\r\n$4\r\n-0.5\r\n"
    )


def test_numpy_floats_go_as_numbers_and_other_objects_are_refused() -> None:
    assert _encoded([np.float64(1.5)]) == b"*1\r\n$3\r\n1.5\r\n"  # repr: np.float64(1.5)
    for unsendable in (True, np.int64(3), None):
        with pytest.raises(TypeError, match="cannot send"):
            _encoded([unsendable])  # type: ignore[list-item]


def test_what_is_not_resp_is_refused() -> None:
    with pytest.raises(ValueError, match="kind"):
        _parsed(b"?what\r\n", 0)


def test_a_redis_address_is_told_without_its_password() -> None:
    """The state's address goes into warnings and RedisAway's messages."""
    state = RedisState("redis://:s3cret@127.0.0.1:1/0", "t:")
    assert state.url == "redis://:***@127.0.0.1:1/0"
    assert RedisState("redis://u:s3cret@h:1/0", "t:").url == "redis://u:***@h:1/0"
    assert RedisState("redis://127.0.0.1:1/0", "t:").url == "redis://127.0.0.1:1/0"
    in_query = RedisState("redis://h:1/?db=2&password=s3cret&x=1", "t:").url  # redis-py reads it
    assert in_query == "redis://h:1/?db=2&password=***&x=1"


@pytest.mark.parametrize(
    ("answer", "for_good"),
    [
        ("WRONGPASS invalid username-password pair or user is disabled.", True),
        ("NOAUTH Authentication required.", True),
        ("ERR AUTH <password> called without any password configured for the default user.", True),
        ("ERR DB index is out of range", True),
        ("LOADING Redis is loading the dataset in memory", False),
        ("BUSY Redis is busy running a script.", False),
        ("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.", False),
        ("ERR max number of clients reached", False),
    ],
)
def test_only_a_refusal_no_wait_changes_stops_a_gateway_at_start(
    answer: str, for_good: bool
) -> None:
    """Redis's answers (7.0's words) to a connection's AUTH, SELECT or PING: a Redis
    restarted beside the gateways answers LOADING for a while."""
    assert refuses_for_good(ResponseError(answer)) is for_good
    assert refuses_for_good(AuthenticationError("invalid username-password pair"))
