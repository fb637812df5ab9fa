"""The emulator's numbered KV-event feed, read page by page as the collector reads it."""

from __future__ import annotations

from sim.emulator.kv_feed import KvEventFeed
from sim.kv_cache import KvBlockPool


def _pool_with_events(count: int) -> KvBlockPool:
    pool = KvBlockPool(num_blocks=count, block_size=1, kv_events=True)
    for block, block_hash in zip(pool.allocate(count), range(100, 100 + count), strict=True):
        pool.register(block, block_hash)
    return pool


def test_events_are_numbered_from_one_and_read_in_pages() -> None:
    feed = KvEventFeed(_pool_with_events(5))
    first = feed.page(after=0, limit=3)
    assert (first.next, first.complete, first.events) == (
        3,
        True,
        ((100, True), (101, True), (102, True)),
    )
    rest = feed.page(after=first.next, limit=3)
    assert (rest.next, rest.complete, rest.events) == (5, True, ((103, True), (104, True)))
    assert feed.page(after=5, limit=3).events == ()
    assert feed.page(after=5, limit=3).next == 5


def test_a_reader_that_fell_behind_the_kept_events_is_told_and_gets_the_oldest() -> None:
    feed = KvEventFeed(_pool_with_events(5), capacity=2)
    page = feed.page(after=1, limit=10)
    assert not page.complete  # events 2 and 3 are gone
    assert (page.next, page.events) == (5, ((103, True), (104, True)))
    assert feed.page(after=3, limit=10).complete


def test_a_number_from_another_run_is_not_complete() -> None:
    feed = KvEventFeed(_pool_with_events(2))
    page = feed.page(after=40, limit=10)  # the reader's number came from a run before
    assert not page.complete
    assert page.events == ((100, True), (101, True))
    assert KvEventFeed(_pool_with_events(1)).epoch != feed.epoch


def test_a_reader_of_another_epoch_gets_this_run_s_events_from_the_first() -> None:
    feed = KvEventFeed(_pool_with_events(3))
    page = feed.page(after=2, limit=10, epoch="the run before")
    assert (page.complete, page.next, page.events) == (
        True,
        3,
        ((100, True), (101, True), (102, True)),
    )
    assert feed.page(after=2, limit=10, epoch=feed.epoch).events == ((102, True),)
