"""Long polls parked on the supervisor: a RESULT_BLOCKING whose first look (in a batch)
found nothing waits for its ACK's event on a callback, not a task of its own (no task
step, no `asyncio.wait` per poll: the answer leaves in the turn the ACK's event arrives).
Their timeouts share one heap and one timer (`Deadlines`): a timer handle made and
cancelled per poll was a cost of every query, and a thousand of them of a dedup storm."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Any

from queryqueue.engine.errors import QueueError
from queryqueue.engine.responses import QueueKey
from queryqueue.engine.store import QueueStore
from queryqueue.engine.waiters import AckEvent, Waiter


class Deadlines:
    """The timeouts of the parked polls of one loop: (loop time, order, poll) in a heap
    behind one timer, armed for the earliest. A poll answered before its deadline stays
    in the heap, skipped when its time comes (compacted once such entries dominate)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._heap: list[tuple[float, int, ParkedPoll]] = []
        self._order = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self.waiting = 0  # polls in the heap not answered yet

    def add(self, poll: ParkedPoll, seconds: float) -> None:
        at = self._loop.time() + seconds
        if len(self._heap) > 4 * self.waiting + 1024:
            self._heap = [entry for entry in self._heap if not entry[2].done]
            heapq.heapify(self._heap)
        heapq.heappush(self._heap, (at, next(self._order), poll))
        self.waiting += 1
        if self._timer is None or at < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._timer_at = self._loop.call_at(at, self._expire), at

    def _expire(self) -> None:
        self._timer = None
        now = self._loop.time()
        heap = self._heap
        while heap and heap[0][0] <= now:
            heapq.heappop(heap)[2].cancel()
        if heap:
            self._timer_at = heap[0][0]
            self._timer = self._loop.call_at(self._timer_at, self._expire)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class ParkedPoll:
    """Answered once: by the ACK that wakes its waiter, with None at its timeout, or with
    None at shutdown or hang-up (`cancel`, as a parked task is cancelled). `finish(ok,
    answer, event)` sends it (`event`: the ACK's, None otherwise); the waiter is
    unsubscribed first."""

    __slots__ = ("_deadlines", "_finish", "_key", "_store", "_waiter", "done")

    def __init__(
        self,
        store: QueueStore,
        key: QueueKey,
        timeout_ms: int,
        waiter: Waiter,
        finish: Callable[[bool, Any, AckEvent | None], None],
        deadlines: Deadlines,
    ) -> None:
        self._store, self._key, self._waiter, self._finish = store, key, waiter, finish
        self._deadlines = deadlines
        self.done = False
        waiter.future.add_done_callback(self._woken)
        deadlines.add(self, timeout_ms / 1000)

    def _woken(self, future: asyncio.Future[AckEvent]) -> None:
        if self.done or future.cancelled():
            return
        event = future.result()
        try:
            answer = self._store.result_blocking_woken(self._key, event)
        except QueueError as exc:
            self._end(False, exc, None)
            return
        self._end(True, answer, event)

    def cancel(self) -> None:
        if not self.done:
            self._end(True, None, None)

    def _end(self, ok: bool, answer: Any, event: AckEvent | None) -> None:
        self.done = True
        self._deadlines.waiting -= 1
        self._store.waiters.unsubscribe(self._waiter)
        self._finish(ok, answer, event)
