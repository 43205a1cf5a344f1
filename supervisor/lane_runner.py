"""A blocking store (PostgreSQL): each prefix's batches run on a lane of the store.

A lane is a thread and a connection, in order; the loop does not wait for them, so a
prefix waiting on a lock holds up neither other prefixes nor pings. While a prefix's
batch is on its lane, what arrives for it waits and goes as the next batch: one
transaction (one commit) for all of it. The pool prefix's next batch waits a moment for
the ACKs its workers are about to send (linger.py), as PostgreSQL's `commit_delay` does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from queryqueue.engine.errors import StoreError
from queryqueue.engine.lanes import route_of
from queryqueue.engine.waiters import Waiter
from queryqueue.supervisor.core.handoff import Pool, Retrieved
from queryqueue.supervisor.core.requests import Request, acks_last, coming, ends_or_waits
from queryqueue.supervisor.runner import Runner

if TYPE_CHECKING:
    from queryqueue.supervisor.server import QueueServer

_log = logging.getLogger("queryqueue.server")


class LaneRunner(Runner):
    # Half a batch at most: the queued commands wait behind it.
    linger_share = 0.5

    def __init__(self, server: QueueServer) -> None:
        super().__init__(server)
        self.lanes_busy: set[asyncio.Task[None]] = set()
        # A prefix whose batch is on its lane: what arrived for it since (`to_lane`).
        self.lane_queued: dict[str, list[Request]] = {}
        self.lingering: dict[str, tuple[asyncio.Future[None], set[Any]]] = {}

    def execute_turn(self) -> None:
        """What arrived, to its prefixes' lanes: the loop never waits on one."""
        self.turn = None
        try:
            for route, group in self.by_route(self.take_batch()).items():
                self.to_lane(route, group)
        finally:
            if self.server.inbox:
                self.schedule()

    def polls_itself(self, request: Request) -> bool:
        """A long poll of its own (not one sent with its ADD) waits on the store, which
        hears of ACKs from every host."""
        if request.follows is not None:
            return False
        self.server.answers.park_on_store(request)
        return True

    def park(self, request: Request, waiter: Waiter) -> None:
        self.server.answers.park_on_store(request, waiter)

    def stop(self) -> None:
        super().stop()
        for waiter, _ in self.lingering.values():  # what lingers runs now
            if not waiter.done():
                waiter.set_result(None)

    def waiting_for_acks(self) -> bool:
        return bool(self.lingering)

    def idle(self, prefix: str | None) -> bool:
        """A lane lingers only while its route is in `lane_queued`."""
        return prefix not in self.lane_queued and self.turn is None and not self.server.inbox

    async def finish(self) -> None:
        await asyncio.gather(*self.lanes_busy, return_exceptions=True)

    def by_route(self, batch: list[Request]) -> dict[str | None, list[Request]]:
        """A batch split by the prefix each command is about, in arrival order. A command
        by queue id about an item the pool holds (its workers' ACKs) goes with the pool's
        prefix: into the same transactions as the ADDs and RETRIEVEs it frees a slot for."""
        groups: dict[str | None, list[Request]] = {}
        held = self.server.job if self.server.pools else None
        for request in batch:
            # A long poll sent with its ADD runs with it (it reads the id the ADD answers).
            route = route_of(tuple((request.follows or request).args))
            if route is None and held is not None and request.args:
                job = held(request.args[0]) if isinstance(request.args[0], int) else None
                route = job.path.rpartition(":")[0] if job is not None else None
                if job is not None and request.method == "ack" and job.sent_at is not None:
                    self.linger.acked(job.sent_at, time.monotonic())
            groups.setdefault(route, []).append(request)
        return groups

    def to_lane(self, route: str | None, group: list[Request]) -> None:
        """PostgreSQL: each prefix's commands go to a lane of the store (a thread and a
        connection, in order); the loop does not wait for them, so a prefix waiting on a
        lock holds up neither other prefixes nor pings. While a prefix's batch is on its
        lane, what arrives for it waits and goes as the next batch: one transaction (one
        commit) for all of it. Commands by queue id (no prefix) are not held back: each
        group takes the least loaded lane, as one of them may wait on any prefix's lock."""
        if route is not None and route in self.lane_queued:
            self.lane_queued[route].extend(group)
            lingering = self.lingering.get(route)
            if lingering is not None:
                waiter, awaited = lingering
                # An ACK came, or the worker waits for another command's answer: no ACK
                # comes before the batch answers it.
                awaited.difference_update(r.args[0] for r in group if ends_or_waits(r))
                if not awaited and not waiter.done():
                    waiter.set_result(None)
            return
        if route is not None:
            self.lane_queued[route] = []
        task = asyncio.ensure_future(self.execute_off_loop(group, route))
        self.lanes_busy.add(task)
        task.add_done_callback(self.lanes_busy.discard)

    async def execute_off_loop(self, batch: list[Request], route: str | None) -> None:
        try:
            while batch:
                pool = self.transaction.hand_off.pool_for(route)
                lingers = pool is not None and pool in self.transaction.retrieving_pools()
                if lingers:
                    assert route is not None and pool is not None
                    batch = await self.linger_for_acks(route, batch, pool)
                batch = acks_last(batch)
                if pool is not None and route is not None:
                    self.transaction.rooms[route] = self.transaction.room_at_dispatch(pool, batch)
                effects: list[Callable[[], object]] = []
                began = time.monotonic()
                try:
                    answers, for_pool, effects = await self.server.store.run_off_loop(
                        self.execute_deferring, batch, route, route=route
                    )
                except RuntimeError as exc:  # its lanes are shut down: none of it ran
                    answers, for_pool = (
                        [(False, StoreError(f"the store is closed: {exc}"))] * len(batch),
                        None,
                    )
                try:
                    self.settle(batch, answers, for_pool, effects)
                except Exception:  # a bug: the prefix's next commands must still run
                    _log.exception("answering a batch of %d commands failed", len(batch))
                if lingers:
                    self.linger.ran(time.monotonic() - began)
                batch = self.next_for_lane(route)
        except asyncio.CancelledError:
            if route is not None:
                self.lane_queued.pop(route, None)
            raise

    def execute_deferring(
        self, batch: list[Request], route: str | None
    ) -> tuple[list[tuple[bool, Any]], Retrieved | None, list[Callable[[], object]]]:
        """`BatchTransaction.execute` on a lane, its after-commit effects (the waiters its ACKs wake)
        handed back to run on the loop with its answers: waking them from the lane cost
        the loop a wake-up of its own for each (`call_soon_threadsafe`)."""
        with self.server.store.deferring_effects() as effects:
            answers, for_pool = self.transaction.execute(batch, route)
        return answers, for_pool, effects

    async def linger_for_acks(self, route: str, batch: list[Request], pool: Pool) -> list[Request]:
        """The pool prefix's next batch, once the ACKs of the queries its workers were
        just handed have arrived (or are overdue): one batch for them all (linger.py)."""
        loop = self.server.loop()
        # Workers with a command here wait for its answer: their ACKs are not coming.
        arriving = coming(batch, self.lane_queued.get(route, ()))
        now = time.monotonic()
        awaited, until = self.linger.awaited(pool.running(), arriving, now)
        if not awaited:
            return batch
        waiter: asyncio.Future[None] = loop.create_future()
        self.lingering[route] = (waiter, awaited)
        timer = Deadline(loop, until, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            del self.lingering[route]
            # Back in front of what arrived meanwhile, taken again as one batch.
            self.lane_queued[route] = batch + self.lane_queued.get(route, [])
        return self.next_for_lane(route)

    def next_for_lane(self, route: str | None) -> list[Request]:
        """What arrived for `route` while its batch ran (at most `max_batch`); none left:
        the route is free, its next command starts a lane task of its own."""
        if route is None:
            return []
        queued = self.lane_queued.pop(route, [])
        if queued:
            self.lane_queued[route] = queued[self.server.inbox.max_batch :]
        return queued[: self.server.inbox.max_batch]


class Deadline:
    """Resolves `waiter` at `until` (`time.monotonic()`). The loop's timers go by its own
    clock, in whole ms on uvloop and read once a loop turn, so one may fire a good part of
    a ms early: it is armed again for what is left."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, until: float, waiter: asyncio.Future[None]
    ) -> None:
        self._loop, self._until, self._waiter = loop, until, waiter
        self._timer = loop.call_later(until - time.monotonic(), self._fire)

    def _fire(self) -> None:
        left = self._until - time.monotonic()
        if left > 0:
            self._timer = self._loop.call_later(left, self._fire)
        elif not self._waiter.done():
            self._waiter.set_result(None)

    def cancel(self) -> None:
        self._timer.cancel()
