"""Cube's reconcileQueue: what a process does after anything changed in its queue.

It reaps stalled and orphaned items (at most once per REAP_INTERVAL_MS per process: their
timeouts are tens of seconds), then retrieves from PENDING, in priority order, what the
queue's concurrency leaves room for, and processes it. Single-flight, as in Cube: callers
during a run share it and cause exactly one more run.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from queryqueue.engine import events as ev
from queryqueue.engine.hashing import may_run_in
from queryqueue.engine.responses import QueueId
from queryqueue.engine.retrieved import RetrievedQuery

if TYPE_CHECKING:
    from queryqueue.engine.queue import QueryQueue

REAP_INTERVAL_MS = 1000


class Reconciler:
    def __init__(self, queue: QueryQueue) -> None:
        self.queue = queue
        self._task: asyncio.Task[None] | None = None
        self._again = False
        self.runs = 0  # completed runs, for stats and tests
        self._reaped_at: int | None = None  # when this process last looked for stalled items

    async def finish(self) -> bool:
        """Wait for a run in flight; whether there was one."""
        task = self._task
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)
        return task is not None

    @property
    def running(self) -> bool:
        return self._task is not None

    async def run(self) -> None:
        """Single-flight: callers during a run share it and cause exactly one more run."""
        if self._task is None:
            self._again = False
            self._task = asyncio.ensure_future(self._loop())
        else:
            self._again = True
        await asyncio.shield(self._task)

    async def _loop(self) -> None:
        # Cube clears the flag only when it creates a run: calls that arrive after the run
        # was created (even before it started) cause exactly one more.
        try:
            while True:
                await self.once()
                self.runs += 1
                if not self._again:
                    return
                self._again = False
        finally:
            self._task = None

    async def once(self) -> None:
        """One reconcile: reap stalled and orphaned items (now and then), then take from
        PENDING what the concurrency leaves room for."""
        queue = self.queue
        conn = queue.connection
        # Stalled and orphaned items are looked for at most once per REAP_INTERVAL_MS per
        # process: their timeouts are tens of seconds, and every process reconciles, so
        # this costs a reaped item at most that much more life and saves a round trip on
        # the path of every query.
        now = queue.clock.now_ms()
        if self._reaped_at is None or now - self._reaped_at >= REAP_INTERVAL_MS:
            self._reaped_at = now
            to_cancel = await conn.get_queries_to_cancel()
            if to_cancel:
                await asyncio.gather(*(self._remove_orphaned(h, q) for h, q in to_cancel))
        # One round trip for both listings: PENDING's limit is trimmed once ACTIVE is known.
        active, to_process = await asyncio.gather(
            conn.get_active_queries(), conn.get_to_process_queries(limit=queue.concurrency)
        )
        to_process_limit = (
            1 if len(active) >= queue.concurrency else queue.concurrency - len(active)
        )
        # The store hides other processes' persistent items already; the suffix check keeps
        # the design's rule explicit should a driver not.
        if queue.room_here is not None:
            to_process_limit = min(to_process_limit, queue.room_here())
        mine = [(h, q) for h, q in to_process if may_run_in(h, queue.process_uid)][
            :to_process_limit
        ]
        await asyncio.gather(*(queue.process_query(h, q) for h, q in mine))

    async def _remove_orphaned(self, query_key_hash: str, queue_id: QueueId) -> None:
        queue = self.queue
        if queue_id in queue.executor.executions or (queue.held_here and queue.held_here(queue_id)):
            # Alive here: its heartbeats were late (the store away, a lane behind), and
            # reaping it would run it twice. Beaten now instead.
            await queue.connection.update_heartbeat(query_key_hash, queue_id)
            return
        query_def = await queue.connection.get_query_and_remove(query_key_hash, queue_id)
        if query_def is None:
            return
        queue.events.emit(
            ev.REMOVING_ORPHANED,
            {
                "queueId": queue_id,
                "queryKey": query_def.get("queryKey"),
                "queuePrefix": queue.prefix,
                "requestId": query_def.get("requestId"),
            },
        )
        await queue.send_cancel_message_fn(query_def, queue_id)


async def process_query(queue: QueryQueue, query_key_hash: str, queue_id: QueueId | None) -> None:
    """Cube's processQuery: retrieve the item and hand it off. Never executes it: the
    hand-off returns first."""
    try:
        got = await queue.connection.retrieve_for_processing(query_key_hash)
        activated = query_key_hash in got.active_keys
        if got.query is None or got.queue_id is None or not activated:
            queue.events.emit(
                ev.SKIP_PROCESSING,
                {
                    "queueId": queue_id,
                    "queryKey": query_key_hash,
                    "queuePrefix": queue.prefix,
                    "activeKeys": list(got.active_keys),
                    "activated": activated,
                    "queryExists": got.query is not None,
                },
            )
            await queue.connection.free_processing_lock(query_key_hash, queue_id)
            return
        retrieved = RetrievedQuery(
            query_key_hash, got.queue_id, got.queue_id, got.queue_size, got.query
        )
        try:
            await queue.send_process_message_fn(retrieved)
        except Exception as exc:
            queue.events.emit(
                ev.ERROR_PROCESSING_MESSAGE,
                {
                    "queueId": got.queue_id,
                    "queryKey": got.query.get("queryKey"),
                    "queuePrefix": queue.prefix,
                    "error": repr(exc),
                },
            )
    except Exception as exc:
        queue.events.emit(
            ev.QUEUE_STORAGE_ERROR,
            {
                "queueId": queue_id,
                "queryKey": query_key_hash,
                "queuePrefix": queue.prefix,
                "error": repr(exc),
            },
        )
