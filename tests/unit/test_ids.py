"""Event and request ids (``schemas/ids.py``)."""

from __future__ import annotations

import multiprocessing

from schemas.ids import unique_id


def _ids_of_a_child(queue: multiprocessing.Queue[list[str]]) -> None:
    queue.put([unique_id() for _ in range(100)])


def test_ids_are_32_hex_digits_and_never_repeat_in_a_process() -> None:
    ids = [unique_id() for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 32 and set(i) <= set("0123456789abcdef") for i in ids)


def test_a_forked_child_makes_ids_of_its_own() -> None:
    """A child forked after its parent made ids would repeat them, count and all."""
    ours = [unique_id() for _ in range(100)]
    fork = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue[list[str]] = fork.Queue()
    child = fork.Process(target=_ids_of_a_child, args=(queue,))
    child.start()
    theirs = queue.get(timeout=30)
    child.join(30)
    assert child.exitcode == 0
    later = [unique_id() for _ in range(100)]
    assert not set(theirs) & set(ours + later)
