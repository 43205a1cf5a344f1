"""Long polls parked on the supervisor: a RESULT_BLOCKING whose first look (in a batch)
found nothing waits for its ACK's event on a callback, not a task of its own (no task
step, no `asyncio.wait` per poll: the answer leaves in the turn the ACK's event arrives).
Their timeouts share one heap and one timer (`deadlines.Deadlines`, `parked_deadlines`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from queryqueue.driver_socket.deadlines import Deadlines
from queryqueue.engine.errors import QueueError
from queryqueue.engine.responses import QueueKey
from queryqueue.engine.store import QueueStore
from queryqueue.engine.waiters import AckEvent, Waiter


class ParkedPoll:
    """Answered once: by the ACK that wakes its waiter, with None at its timeout, or with
    None at shutdown or hang-up (`cancel`, as a parked task is cancelled). `finish(ok,
    answer, event)` sends it (`event`: the ACK's, None otherwise); the waiter is
    unsubscribed first."""

    __slots__ = ("_finish", "_key", "_store", "_waiter", "done")

    def __init__(
        self,
        store: QueueStore,
        key: QueueKey,
        timeout_ms: int,
        waiter: Waiter,
        finish: Callable[[bool, Any, AckEvent | None], None],
        deadlines: Deadlines[ParkedPoll],
    ) -> None:
        self._store, self._key, self._waiter, self._finish = store, key, waiter, finish
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
        waiter = self._waiter
        self._store.waiters.unsubscribe(waiter)
        # Let go of what holds this poll in a cycle (with its request, its waiter and the
        # ACK's event) that only the cyclic GC would free, ~10 objects a query under load:
        # its waiter's future's callback (a poll that timed out; a woken one's future has
        # let go of it already), and `finish`, a closure that holds the poll.
        waiter.future.remove_done_callback(self._woken)
        finish, self._finish = self._finish, _answered
        finish(ok, answer, event)


def _answered(ok: bool, answer: Any, event: AckEvent | None) -> None:
    """The `finish` of a poll already answered: nothing is sent twice."""


def parked_deadlines(loop: asyncio.AbstractEventLoop) -> Deadlines[ParkedPoll]:
    """The timeouts of a loop's parked polls: one that is still waiting at its deadline is
    answered with its timeout answer (`cancel`)."""
    return Deadlines(loop, expire=ParkedPoll.cancel, live=_waiting)


def _waiting(poll: ParkedPoll) -> bool:
    return not poll.done
