"""Faust's parts as the table worker needs them (faust-streaming 0.15): the app, its
consumer, producer and recovery, its worker, and tables written from batches. Each class
says which of Faust's behaviours it changes, and what that behaviour cost."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import traceback
from collections import Counter
from collections.abc import Coroutine, Iterator, Mapping
from types import TracebackType
from typing import Any, cast

import faust
import pydantic_core
from faust.serializers import codecs
from faust.tables.manager import TableManager
from faust.tables.recovery import Recovery
from faust.transport.consumer import Consumer, RecordMap
from faust.transport.drivers import aiokafka as faust_kafka
from faust.transport.producer import ProducerBuffer
from faust.types import TP
from faust.types.tuples import FutureMessage
from faust.worker import Worker
from mode.services import WaitResults
from mode.utils.tracebacks import Traceback
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from schemas.topics import COMPACTED_SEGMENT_MS
from streams.kafka import keep_tracked

log = logging.getLogger(__name__)

FETCH_MAX_WAIT_MS = 100
"""How long the broker may hold the worker's fetch for data (Faust sets 1,500 ms; Kafka's
default is 500). aiokafka keeps one fetch in flight per broker, for the partitions whose
fetched records are used up: while the broker holds it, partitions used up meanwhile wait
for it too, and the worker sits idle with records on the broker. In the streams bench's
bulk run (20,000 requests, one worker, this project's 2-core machine) the drain took
6.8 s, or 8.4 s where it met such a hold; at its end the re-keyed updates, produced
seconds before, came in a fetch that had waited 0.78 s (logged from aiokafka's answers).
With 100 ms, in eight runs alternating with six of the commit before: 6.6 to 7.8 s,
against 6.8 s three times and 8.4 s three times. An idle worker asks ten times a second."""


class RustJson(codecs.Codec):
    """JSON written and read by pydantic-core's encoder and parser instead of the standard
    library's (Faust's ``json`` codec): the same values (infinities as ``Infinity``, as
    ``json.dumps`` writes them, whose records it reads back the same), in a fifth of the
    time for a join state (0.74 against 3.66 us to write, 1.08 against 3.06 us to read).
    An ASCII string key is the same bytes in both, so compaction still replaces a key an
    earlier version wrote; the worker's keys are (request and instance ids, DC names). A
    key with other characters differs (``json.dumps`` escapes them), which recovery,
    reading the records in order, still ends with the right value of."""

    def _dumps(self, obj: Any) -> bytes:
        return pydantic_core.to_json(obj, inf_nan_mode="constants")

    def _loads(self, s: bytes) -> Any:
        return pydantic_core.from_json(s)


RUST_JSON = "rust-json"
"""The name ``RustJson`` is registered under, as a Faust serializer."""
codecs.register(RUST_JSON, RustJson())


class DrainingProducer(faust_kafka.Producer):
    """Faust's producer, with a flush that returns only once the broker acknowledged every
    write handed to it before the flush.

    Faust flushes the producer before it commits offsets, so that what an event wrote
    reaches the broker before the event counts as done. Table changelog writes wait in
    the producer's buffer, and its flush (faust-streaming 0.15, ``ProducerBuffer.flush``)
    gives up when no message left the buffer for 0.1 s; and an empty buffer is not enough
    either: the write the buffer took last may still be on its way into aiokafka's batches
    (waiting for metadata or room), which aiokafka's flush does not cover. A commit could
    then pass a table write still in flight, and a worker killed just after lost it (both
    seen in the kill test: requests never joined, and a DC's slice one completion short).

    Once a write was refused, or abandoned by a buffer that stopped, every later flush
    fails, so no commit passes it (the one at shutdown included): the worker stops, and
    the events are read again when it restarts.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.app.conf.producer_threaded:  # its callbacks would come from another thread
            raise ValueError("the table worker's producer tracks its writes on one loop")
        if self.app.in_transaction:  # its writes would go through other aiokafka clients
            raise ValueError("the table worker is at-least-once: one aiokafka producer")
        self.buffer = self._tracked = TrackedBuffer(loop=self.loop, beacon=self.beacon)
        self.buffer.app = self.app

    async def flush(self) -> None:
        await super().flush()
        await self._tracked.acknowledged()

    async def send(self, topic: str, *args: Any, **kwargs: Any) -> Any:
        """Faust's send, to a topic aiokafka tracks (``keep_tracked``)."""
        keep_tracked(self._ensure_producer().client, topic)
        return await super().send(topic, *args, **kwargs)


class TrackedBuffer(ProducerBuffer):
    """Faust's producer buffer, remembering each write until the broker answered it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._unanswered: set[asyncio.Future[Any]] = set()
        self._refused: BaseException | None = None

    def put(self, fut: FutureMessage) -> None:
        self._unanswered.add(fut)
        fut.add_done_callback(self._answered)
        super().put(fut)

    async def _send_pending(self, fut: FutureMessage) -> None:
        """Hand ``fut`` on; if that fails (aiokafka refusing it at once, say, for want of
        metadata during an outage), fail ``fut`` too: no answer would ever come for it."""
        try:
            await super()._send_pending(fut)
        except BaseException as exc:
            if not fut.done():
                fut.set_exception(exc)
            raise

    def _answered(self, fut: asyncio.Future[Any]) -> None:
        self._unanswered.discard(fut)
        exception = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
        if exception is not None and self._refused is None:
            self._refused = exception

    async def acknowledged(self) -> None:
        """Wait until the broker answered every write put before this call (later ones
        are the next flush's: under steady writes the set is never empty); raise if any
        write was ever refused, or if the buffer stopped with writes it never sent."""
        waiting = set(self._unanswered)
        while waiting and self._refused is None:
            if self.should_stop or self.crashed:
                raise RuntimeError(f"the producer stopped with {len(waiting)} writes unsent")
            await asyncio.wait(waiting, timeout=1.0)
            waiting = {fut for fut in waiting if not fut.done()}
        if self._refused is not None:
            raise RuntimeError(f"a table write was not delivered: {self._refused!r}")


class RewindingConsumer(faust_kafka.Consumer):
    """Faust's consumer, asking aiokafka for the partitions active when it asks, and
    rewinding, at the end of every recovery, the input partitions that have no committed
    offset to their first record; its fetches wait at most ``FETCH_MAX_WAIT_MS``.

    Faust hands aiokafka its own set of active partitions, which it changes while aiokafka
    answers on its thread: a recovery that has read its changelogs pauses them, emptying
    the set. aiokafka answers an empty set with the records of every partition, moving
    past them, and Faust keeps those of active partitions only. A copy taken when Faust
    asks cannot change under aiokafka.

    Faust skips records in other places too (of a generation that ended, of queues it
    empties), counting on the seek to the committed offsets at the recovery's end to read
    them again; aiokafka's seek leaves a partition with no committed offset where it is.
    The worker reads from the earliest offset, so the first record is where such a
    partition starts anyway. (Seen: a restarted worker of a group that had never committed
    took in none of its inputs and published its recovered state alone; see
    ``docs/streams.md``, "Records skipped where no offset was committed".)
    """

    def _new_consumer_thread(self) -> faust_kafka.AIOKafkaConsumerThread:
        return _ConsumerThread(self, loop=self.loop, beacon=self.beacon)

    async def wait_first(
        self,
        *coros: Any,
        timeout: Any = None,  # noqa: ASYNC109 (mode's signature)
    ) -> WaitResults:
        """Faust's drain loop waits, for every message, on its delivery to the agents or a
        suspension of the flow (its only call here), and mode wraps both, and the service's
        stop and crash, in four tasks: 12 % of the worker's main thread in a profile of the
        streams bench's drain. A delivery that finishes without waiting (the agents'
        queues have room, as they mostly do) is run here at once, as the first step of its
        task would have run; one that must wait goes on, from where it stopped, in mode's
        wait as before (``_resumed``).

        Narrower than mode's: the answer to two coroutines ignores the service's stop and
        crash (the drain loop ignores the answer), and the first step runs in the drain
        loop's task and context, not a copy (nothing in Faust's delivery sets a context
        variable or opens a timeout)."""
        if len(coros) != 2 or timeout is not None or not all(map(asyncio.iscoroutine, coros)):
            return await super().wait_first(*coros, timeout=timeout)
        delivery = coros[0]
        try:
            waiting = delivery.send(None)
        except BaseException as ended:
            coros[1].close()  # the suspension's wait, never started
            if not isinstance(ended, StopIteration):
                raise
            return WaitResults([delivery], [ended.value], False)
        return await super().wait_first(_resumed(delivery, waiting), coros[1])

    async def _getmany(
        self,
        active_partitions: set[TP] | None,
        timeout: float,  # noqa: ASYNC109 (Faust's signature)
    ) -> RecordMap:
        asked = None if active_partitions is None else set(active_partitions)
        return await super()._getmany(asked, timeout)

    async def seek_to_committed(self) -> Mapping[TP, int]:
        committed = await super().seek_to_committed()
        never = [tp for tp, at in committed.items() if not at and not self._is_changelog_tp(tp)]
        if never:
            await self.seek_wait(await self.earliest_offsets(*never))
        return committed


async def _resumed(coro: Coroutine[Any, Any, Any], waiting: Any) -> Any:
    """Go on with ``coro``, which has run up to awaiting ``waiting`` (the future it
    yielded, or None for a bare yield), as the task running it would: resumed once the
    future is done (a failed future raises in ``coro``, at its await); cancelled, it
    cancels the future and throws the cancellation in at once. Enough for Faust's delivery,
    which awaits this loop's futures and bare yields; unlike a task, it does not wait for
    an awaited task to finish its own cancellation first."""
    while True:
        try:
            if waiting is None:
                await asyncio.sleep(0)
            else:
                waiting._asyncio_future_blocking = False
                await asyncio.wait({waiting})
        except asyncio.CancelledError:
            if waiting is not None:
                waiting.cancel()
            try:
                waiting = coro.throw(asyncio.CancelledError())
            except StopIteration as done:
                return done.value
            continue
        try:
            waiting = coro.send(None)
        except StopIteration as done:
            return done.value


class _ConsumerThread(faust_kafka.AIOKafkaConsumerThread):
    """Faust's thread for aiokafka's consumer, whose fetches the broker holds at most
    ``FETCH_MAX_WAIT_MS`` (Faust fixes 1,500 ms in the consumer it creates)."""

    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        consumer._fetch_max_wait_ms = FETCH_MAX_WAIT_MS  # read when its fetcher starts
        return consumer


class _Transport(faust_kafka.Transport):
    Consumer = RewindingConsumer


class WorkerApp(faust.App):
    """Faust's app, consuming through ``RewindingConsumer``, producing through
    ``DrainingProducer`` and recovering tables through ``RecoveringTableManager``;
    ``processed`` counts what its agents took in, by kind, ``dead_lettered`` the records
    it could not decode, by topic (``dead_letters_unsent`` those whose letter it could not
    send), and ``published`` its table snapshots, by topic (``WorkerMetrics`` shows them
    to Prometheus)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, TableManager=RecoveringTableManager, **kwargs)
        self.processed: Counter[str] = Counter()
        self.dead_lettered: Counter[str] = Counter()
        self.dead_letters_unsent: Counter[str] = Counter()
        self.published: Counter[str] = Counter()

    def _new_transport(self) -> faust_kafka.Transport:
        if self.conf.consumer_auto_offset_reset != "earliest":  # where RewindingConsumer goes
            raise ValueError("the table worker reads its partitions from the earliest offset")
        return _Transport(self.conf.broker_consumer, self)

    def _new_producer(self) -> faust_kafka.Producer:
        return DrainingProducer(self.transport, loop=self.loop, beacon=self.beacon)


class WorkerMetrics(Collector):
    """The worker's tallies as Prometheus counters, read when scraped: the event path
    counts once, in the app's own ``Counter``s, and nothing more."""

    def __init__(self, app: WorkerApp) -> None:
        self.app = app

    def collect(self) -> Iterator[Metric]:
        app = self.app
        yield _counter(
            "events", "Events the worker's agents took in, by kind.", "kind", app.processed
        )
        yield _counter(
            "dead_letters",
            "Undecodable records sent to tf.deadletter, by the topic they came from.",
            "topic",
            app.dead_lettered,
        )
        yield _counter(
            "dead_letters_unsent",
            "Undecodable records whose dead letter could not be sent (logged), by topic.",
            "topic",
            app.dead_letters_unsent,
        )
        yield _counter(
            "tables_published", "Table snapshots published, by topic.", "topic", app.published
        )


def _counter(name: str, documentation: str, label: str, tally: Mapping[str, int]) -> Metric:
    family = CounterMetricFamily(f"tokenfleet_worker_{name}", documentation, labels=[label])
    for value, count in dict(tally).items():  # a copy: the worker's loop runs beside us
        family.add_metric([value], count)
    return family


def metrics_registry(app: WorkerApp) -> CollectorRegistry:
    """What the worker's ``/metrics`` serves: its counters and its process's CPU and
    memory."""
    registry = CollectorRegistry()
    registry.register(WorkerMetrics(app))
    ProcessCollector(registry=registry)
    return registry


class FlowHeldRecovery(Recovery):
    """Faust's table recovery, holding flow control off while it ends.

    Its end (faust-streaming 0.15, ``Recovery.on_recovery_completed``) resumes the input
    partitions, seeks them to their committed offsets and then resumes flow control,
    which empties every agent's queue. Where a recovery replayed a changelog, flow
    control was already on: events fetched during the seek went into the queues and
    were dropped there, and a partition with no committed offset was never read again
    (seen: a restarted worker that never counted the telemetry first published while it
    was down, and a worker that missed 44 of 200 completions after a second rebalance).
    Held off, the fetcher waits for flow control with those events in hand and delivers
    them once it resumes (``tests/integration/test_tables_recovery.py``).
    """

    async def on_recovery_completed(self, generation_id: int = 0) -> None:
        self.app.flow_control.suspend()
        try:
            await super().on_recovery_completed(generation_id)
        except BaseException:
            # A seek that timed out ends recovery for good (Faust takes the timeout for a
            # stop): flow control left off would stall every agent, silently. A stop or
            # a new rebalance manages flow control itself.
            stopping = self.should_stop or self.app.rebalancing
            if not (stopping or self.signal_recovery_start.is_set()):
                self.app.flow_control.resume()
            raise


class RecoveringTableManager(TableManager):
    """Faust's table manager, recovering with ``FlowHeldRecovery``."""

    @property
    def recovery(self) -> Recovery:
        if self._recovery is None:
            self._recovery = FlowHeldRecovery(self.app, self, beacon=self.beacon, loop=self.loop)
        return self._recovery


class JsonTable(faust.Table[Any, Any]):
    """A table whose changelog carries its keys and values as JSON written by pydantic-core
    (``RustJson``). Faust picks a table's changelog serializers from its key and value
    types, not its schema: ``json``, the standard library's, for anything but a Faust
    record or bytes.

    Its changelog closes a segment every ``COMPACTED_SEGMENT_MS``, as the project's own
    compacted topics do: with the broker's default (7 days or 1 GB), the cleaner seldom
    compacts it, and a worker restarted after days replays every write since, publishing
    nothing while it recovers."""

    def __init__(self, app: faust.App, **options: Any) -> None:
        configs = {"segment.ms": str(COMPACTED_SEGMENT_MS)} | dict(
            options.pop("extra_topic_configs", None) or {}
        )
        super().__init__(app, extra_topic_configs=configs, **options)

    def _serializer_from_type(self, typ: Any) -> str:
        return "raw" if typ is bytes else RUST_JSON


class SinglePartitionTable(JsonTable):
    """A table with one partition, written per batch of updates rather than per event.

    Faust places a change in the partition of the event being processed, or, with
    ``use_partitioner``, asks the producer; but at start-up the producer's metadata may not
    list the changelog topic yet, and the write fails. One partition has one answer.
    """

    def partition_for_key(self, key: Any) -> int:
        return 0


class SourcePartitionTable(JsonTable):
    """Faust's table, whose check that its changelog has as many partitions as the topic it
    is written from waits until the changelog's metadata has arrived.

    Faust (0.15) compares the two counts at the first write and caches the answer; a
    changelog topic created moments before may still be listed with 0 partitions in the
    consumer's metadata, which Faust takes for a mismatch and the agent dies
    (``PartitionsMismatch``, seen once in ten full test runs). No partitions yet is not
    an answer: the check is left for a later write.
    """

    def _verify_source_topic_partitions(self, source_topic: str) -> None:
        if not self.app.consumer.topic_partitions(self.changelog_topic_name):
            return
        super()._verify_source_topic_partitions(source_topic)


class KeyedTable(JsonTable):
    """A table written from batches: each write names its changelog partition, that of
    the key's own events, where Faust would take the partition of the event it is
    processing, which in a batch is another key's (a worker recovering that partition after
    a rebalance would then miss the key).

    After a rebalance it forgets the keys it wrote to partitions it no longer holds.
    Faust's in-memory store forgets only those it recovered from the changelog; a key
    written here would stay, and if the partition came back after another worker had
    deleted the key and the changelog had compacted the deletion away, the key would
    outlive it (a join state released twice)."""

    _partition: int | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._written_to: dict[str, int] = {}
        """The partition of each key this worker has written and still holds."""

    def put(self, key: str, value: Any, partition: int) -> None:
        with self._writing_to(partition):
            self[key] = value
        self._written_to[key] = partition

    def remove(self, key: str, partition: int) -> Any:
        self._written_to.pop(key, None)
        with self._writing_to(partition):
            return self.pop(key)

    async def on_recovery_completed(self, active_tps: set[TP], standby_tps: set[TP]) -> None:
        held = {tp.partition for tp in active_tps}
        for key in [key for key, partition in self._written_to.items() if partition not in held]:
            self.data.pop(key, None)  # from this worker's copy only: no changelog write
            del self._written_to[key]
        await super().on_recovery_completed(active_tps, standby_tps)

    @contextlib.contextmanager
    def _writing_to(self, partition: int) -> Iterator[None]:
        self._partition = partition
        try:
            yield
        finally:
            self._partition = None

    def partition_for_key(self, key: Any) -> int:
        if self._partition is None:
            raise RuntimeError("write the join table with put or remove, naming the partition")
        return self._partition


class TaskListingWorker(Worker):
    """Faust's worker, which on ``kill -USR1`` logs what its app processed, whether flow
    is on, and each asyncio task's stack, a line a task: what a worker that stopped making
    progress waits on. (mode's own answer to the signal prints every frame's source and
    locals: pages a task, some sixty tasks.)"""

    def _on_sigusr1(self) -> None:
        consumer = cast(Consumer, self.app.consumer)
        log.warning(
            "processed %s; consumer flow %s, flow control %s; %d partitions paused",
            dict(getattr(self.app, "processed", {})),
            "on" if consumer.flow_active else "off",
            "on" if self.app.flow_control.is_active() else "off",
            len(consumer._paused_partitions),
        )
        for task in asyncio.all_tasks(self.loop):
            log.warning("task %s: %s", task.get_name(), _frames(task))


def _frames(task: asyncio.Task[Any]) -> str:
    """The frames ``task`` waits in, outermost first (mode walks the awaits)."""
    try:
        stack = cast(TracebackType, Traceback.from_task(task))
        return " > ".join(f"{f.f_code.co_name}:{line}" for f, line in traceback.walk_tb(stack))
    except (AttributeError, RuntimeError) as exc:  # a stack mode cannot walk
        return f"(mode could not walk it: {type(exc).__name__})"  # its message lists dir()
