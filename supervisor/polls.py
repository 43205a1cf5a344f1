"""Long polls parked on the supervisor: a RESULT_BLOCKING whose first look (in a batch)
found nothing waits for its ACK's event on a callback and one timer, not a task of its own
(no task step, no `asyncio.wait` per poll: the answer leaves in the turn the ACK's event
arrives)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from queryqueue.engine.errors import QueueError
from queryqueue.engine.responses import QueueKey
from queryqueue.engine.store import QueueStore
from queryqueue.engine.waiters import AckEvent, Waiter


class ParkedPoll:
    """Answered once: by the ACK that wakes its waiter, with None at its timeout, or with
    None at shutdown or hang-up (`cancel`, as a parked task is cancelled). `finish(ok,
    answer)` sends it; the waiter is unsubscribed first."""

    __slots__ = ("_finish", "_key", "_store", "_timer", "_waiter", "done")

    def __init__(
        self,
        store: QueueStore,
        key: QueueKey,
        timeout_ms: int,
        waiter: Waiter,
        finish: Callable[[bool, Any], None],
    ) -> None:
        self._store, self._key, self._waiter, self._finish = store, key, waiter, finish
        self.done = False
        waiter.future.add_done_callback(self._woken)
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(timeout_ms / 1000, self.cancel)

    def _woken(self, future: asyncio.Future[AckEvent]) -> None:
        if self.done or future.cancelled():
            return
        try:
            answer = self._store.result_blocking_woken(self._key, future.result())
        except QueueError as exc:
            self._end(False, exc)
            return
        self._end(True, answer)

    def cancel(self) -> None:
        if not self.done:
            self._end(True, None)

    def _end(self, ok: bool, answer: Any) -> None:
        self.done = True
        self._timer.cancel()
        self._store.waiters.unsubscribe(self._waiter)
        self._finish(ok, answer)
