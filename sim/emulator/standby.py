"""Standby GPUs on an emulated fleet: replicas that FleetMind's long cycle starts and
takes back (``tf.control.placement``), with the lag and the cost a real one has.

A placed replica starts listening only after its warm-up (a vLLM server opens its port
once the model's weights are loaded), so the collector scrapes it, and the gateways
count it ready, no sooner. A replica taken back stops taking requests at once and
finishes what it runs. A recommendation read after its TTL is not applied (it sized a
demand that is gone); one applied stays in force until the next, as a deployment keeps
its replicas when the controller goes quiet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Sequence

from control.controllers.placement import instances_to_run
from schemas.control import PlacementRecommendation
from schemas.fleet import InstanceConfig

log = logging.getLogger(__name__)

WARMUP_S = 60.0
"""A replica's load time: a 70B model's weights read into four GPUs (the simulator's
``FleetSimulation`` default)."""

Serve = Callable[[InstanceConfig], contextlib.AbstractAsyncContextManager[object]]


class StandbyReplicas:
    """The standby instances among ``instances`` (every instance of one process's DCs,
    wherever it runs: the base deployment counts them all) that are in ``local``, each
    served by ``serve`` while the newest recommendation for its DC places it."""

    def __init__(
        self,
        instances: Sequence[InstanceConfig],
        local: Collection[str],
        serve: Serve,
        warmup_s: float = WARMUP_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.instances = tuple(instances)
        self.dcs = frozenset(i.dc for i in self.instances)
        self.local = frozenset(local)
        self.serve = serve
        self.warmup_s = warmup_s
        self.clock = clock
        self._placed: dict[str, PlacementRecommendation] = {}
        """The recommendation in force per DC."""
        self._replicas: dict[str, asyncio.Task[None]] = {}
        """Each placed standby instance: warming up, then serving until cancelled."""
        self._stopping: set[asyncio.Task[None]] = set()
        """Replicas taken back, finishing what they run."""
        self.started: dict[str, float] = {}
        """When each placed instance began to listen (clock seconds), while it runs."""

    def apply(self, message: object) -> None:
        """Take in a placement read from the bus: a newer, unexpired one for one of our
        DCs (or any unexpired one where the one in force has expired: a controller
        started again on a new topic) starts the replicas it adds and stops those it
        takes back."""
        if not isinstance(message, PlacementRecommendation) or message.scope not in self.dcs:
            return
        if not message.replaces(self._placed.get(message.scope), self.clock()):
            return
        self._placed[message.scope] = message
        wanted = set().union(
            *(
                instances_to_run([i for i in self.instances if i.dc == dc], placed)
                for dc, placed in self._placed.items()
            )
        )
        for instance in (i for i in self.instances if i.standby and i.id in self.local):
            replica = self._replicas.get(instance.id)
            if instance.id in wanted and (replica is None or replica.done()):  # or it failed
                log.info("placing a replica on %s (ready in %.0f s)", instance.id, self.warmup_s)
                self._replicas[instance.id] = asyncio.create_task(self._run(instance))
            elif instance.id not in wanted and replica is not None:
                log.info("taking the replica on %s back", instance.id)
                replica.cancel()
                self._stopping.add(replica)
                replica.add_done_callback(self._stopping.discard)
                del self._replicas[instance.id]

    async def _run(self, instance: InstanceConfig) -> None:
        """Warm up, then serve until cancelled; a failure is logged, and the next
        placement that asks for the replica starts it again."""
        await asyncio.sleep(self.warmup_s)
        try:
            async with self.serve(instance):
                self.started[instance.id] = self.clock()
                await asyncio.Event().wait()
        except Exception:
            log.exception("the replica on %s failed", instance.id)
        finally:
            if self._replicas.get(instance.id) in (None, asyncio.current_task()):
                self.started.pop(instance.id, None)  # not a replica placed after this one

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[StandbyReplicas]:
        """Stop every placed replica on exit."""
        try:
            yield self
        finally:
            replicas = [*self._replicas.values(), *self._stopping]
            for replica in replicas:
                replica.cancel()
            await asyncio.gather(*replicas, return_exceptions=True)
            self._replicas.clear()
