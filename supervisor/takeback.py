"""What the worker pool takes back from its workers, through the store: the query of a
worker that died (its waiters retry it, or, once it has killed `max_worker_deaths`
workers, it fails for them), an outcome a worker could not store (given back, to run
again), a query its watch timed out, and, at a stop, every item it held unfinished
(pending again, for the next supervisor)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections import OrderedDict
from typing import Any

import orjson

from queryqueue.engine.errors import QueueError, WorkerLostError
from queryqueue.engine.outcome import encode_error, encode_retry
from queryqueue.engine.responses import QueueId
from queryqueue.engine.store import QueueStore

_log = logging.getLogger("queryqueue.pool")
# Paths whose deaths are remembered at most (the oldest forgotten first).
_DEATHS_KEPT = 10_000


class TakeBack:
    def __init__(self, store: QueueStore, app_ref: str, max_worker_deaths: int) -> None:
        if max_worker_deaths < 1:
            raise ValueError("max_worker_deaths must be at least 1")
        self.store, self.app_ref = store, app_ref
        self.max_worker_deaths = max_worker_deaths
        # Worker deaths by path, counted until the query succeeds: a new request for it
        # after it failed fails at its first death, not N more.
        self.deaths: OrderedDict[str, int] = OrderedDict()
        self.reclaimed: list[QueueId] = []
        # Held unfinished at the stop, or handed over while stopping (`requeue_unfinished`).
        self.unfinished: list[tuple[QueueId, str]] = []

    def succeeded(self, path: str) -> None:
        self.deaths.pop(path, None)

    def fenced(self, queue_id: QueueId) -> str:
        """The outcome a query stopped for this host's lapsed lease gets: its waiters ask
        again (no death is counted: the query did nothing wrong)."""
        self.reclaimed.append(queue_id)
        return encode_retry("the host running the query lost its lease; it runs again")

    def died(self, queue_id: QueueId, path: str, exitcode: int | None, counts: bool) -> str | None:
        """The outcome a query whose worker died gets (None: none, it was over anyway):
        its waiters retry it, unless it has now killed `max_worker_deaths` workers."""
        self.reclaimed.append(queue_id)
        if not counts:
            return None
        deaths = self.deaths.pop(path, 0) + 1
        self.deaths[path] = deaths
        while len(self.deaths) > _DEATHS_KEPT:
            self.deaths.popitem(last=False)
        if deaths < self.max_worker_deaths:
            # Its waiters are told at once and ask again together (one new item).
            return encode_retry(
                f"the worker running the query died (exit code {exitcode}); it runs again"
            )
        _log.error(
            "query %s killed its worker %d times (last exit code %s): it fails",
            path,
            deaths,
            exitcode,
        )
        return encode_error(
            WorkerLostError(
                f"the query killed its worker {deaths} times (last exit code {exitcode}):"
                " not run again"
            )
        )

    async def take_back(self, queue_id: QueueId, path: str, outcome: str | None) -> None:
        """A dead worker's item out of the queue at once, and its cancel handler called.
        Tried until the store answers (at most two minutes): a worker that died in an
        outage, or was stopped for one, leaves nothing wedged behind it."""
        for _ in range(120):
            try:
                removed = await self.store.run_off_loop(self.store.cancel, queue_id, result=outcome)
                break
            except QueueError as exc:
                _log.warning("taking back queue item %s failed: %s", queue_id, exc)
                await asyncio.sleep(1.0)
        else:
            return
        if removed is None:
            return
        _log.warning("worker died: reclaimed queue item %s (%s)", queue_id, path)
        definition = orjson.loads(removed.payload)
        if removed.extra:
            with contextlib.suppress(ValueError):
                definition.update(orjson.loads(removed.extra))
        await call_cancel_handler(self.app_ref, definition)

    async def give_back(self, queue_id: QueueId) -> None:
        """Its worker ran it but could not store the outcome (the store was away through
        every retry): reclaim it now, not a stall timeout later, so its waiters ask again.
        Tried until the store answers (at most two minutes)."""
        outcome = encode_retry("the worker could not store the query's outcome; it runs again")
        for _ in range(120):
            try:
                await self.store.run_off_loop(self.store.cancel, queue_id, result=outcome)
                return
            except QueueError as exc:
                _log.warning("giving back queue item %s failed: %s", queue_id, exc)
                await asyncio.sleep(1.0)

    async def fail_timed_out(self, queue_id: QueueId, outcome: str) -> None:
        """A worker's watch timed its query out: its waiters get `outcome` now (a failure
        is logged: the worker's own ACK, or the supervisor's timeout, comes later)."""
        try:
            await self.store.run_off_loop(self.store.cancel, queue_id, result=outcome)
        except Exception:
            _log.exception("failing timed-out queue item %s failed", queue_id)

    async def requeue_unfinished(self) -> None:
        """After a stop: every item held unfinished is pending again, so that the next
        supervisor runs it (one done meanwhile is left as it is). Each is logged."""
        for queue_id, path in self.unfinished:
            try:
                again = await self.store.run_off_loop(self.store.requeue, queue_id)
            except QueueError as exc:
                _log.error("could not give back queue item %s (%s): %s", queue_id, path, exc)
                continue
            if again:
                _log.warning(
                    "gave back queue item %s (%s): unfinished at the stop, pending again",
                    queue_id,
                    path,
                )
        self.unfinished.clear()


async def call_cancel_handler(app_ref: str, definition: dict[str, Any]) -> None:
    from queryqueue.app import load_app

    try:
        app = load_app(app_ref)
        cancel = app.cancel_handlers.get(str(definition.get("queryHandler")))
        if cancel is not None:
            outcome = cancel(definition)
            if inspect.isawaitable(outcome):
                await outcome
    except Exception:
        _log.exception("cancel handler of a reclaimed query failed")
