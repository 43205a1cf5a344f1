"""In-process wake-ups for RESULT_BLOCKING.

A waiter subscribes *before* the store is read, so an ACK that commits between the read
and the wait is still delivered. ACK publishes after its transaction commits; publishing
is thread-safe and never blocks.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass

from queryqueue.engine.aio import runs_here
from queryqueue.engine.responses import QueueId, QueueKey


@dataclass(frozen=True, slots=True)
class AckEvent:
    id: QueueId
    path: str
    result: str | None
    external_id: str | None
    # The ACK's own transaction consumed the result for a waiter by id (decide, then act:
    # the waiter need not consume it in a transaction of its own when it wakes).
    taken: bool = False


class Waiter:
    __slots__ = ("claimed", "future", "key", "loop")

    def __init__(self, key: QueueKey, loop: asyncio.AbstractEventLoop) -> None:
        self.key = key
        self.loop = loop
        self.future: asyncio.Future[AckEvent] = loop.create_future()
        # An ACK has taken the result for it and has yet to commit: its event is due, so
        # a waiter whose timeout comes first waits for it rather than answer nothing.
        self.claimed = False


def running_loop_on(
    home: asyncio.AbstractEventLoop | None, home_thread: int | None
) -> asyncio.AbstractEventLoop | None:
    """This thread's running loop, if any: `home` without asking asyncio when it runs
    here (`runs_here`)."""
    if runs_here(home, home_thread):
        return home
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class ResultWaiters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[QueueKey, set[Waiter]] = {}
        self._home: asyncio.AbstractEventLoop | None = None
        self._home_thread: int | None = None

    @property
    def home(self) -> asyncio.AbstractEventLoop | None:
        """The loop of a waiter subscribed on a thread with none (a blocking store's lane,
        running a server's batch): the server's, set on its thread when it starts."""
        return self._home

    @home.setter
    def home(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self._home, self._home_thread = loop, threading.get_ident()

    def subscribe(self, key: QueueKey) -> Waiter:
        loop = running_loop_on(self._home, self._home_thread) or self._home
        if loop is None:
            raise RuntimeError("no running event loop")
        waiter = Waiter(key, loop)
        with self._lock:
            self._waiters.setdefault(key, set()).add(waiter)
        return waiter

    def unsubscribe(self, waiter: Waiter) -> None:
        with self._lock:
            waiters = self._waiters.get(waiter.key)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._waiters[waiter.key]

    def claim(self, key: QueueKey) -> bool:
        """Whether `key` has waiters, each then `claimed` (see Waiter)."""
        with self._lock:
            waiters = self._waiters.get(key, ())
            for waiter in waiters:
                waiter.claimed = True
            return bool(waiters)

    def count(self) -> int:
        with self._lock:
            return sum(len(w) for w in self._waiters.values())

    def publish(self, event: AckEvent) -> int:
        """Wake every waiter of the item, addressed by id or by path. Returns how many."""
        with self._lock:
            targets = [*self._waiters.pop(event.id, ()), *self._waiters.pop(event.path, ())]
        running = running_loop_on(self._home, self._home_thread)
        for waiter in targets:
            if waiter.loop is running:
                _resolve(waiter.future, event)
            elif not waiter.loop.is_closed():
                waiter.loop.call_soon_threadsafe(_resolve, waiter.future, event)
        return len(targets)


def _resolve(future: asyncio.Future[AckEvent], event: AckEvent) -> None:
    if not future.done():
        future.set_result(event)


class SlotWatchers:
    """Callbacks told that a slot may have freed (an ACK or CANCEL committed), each on the
    loop that registered it: a blocking store commits on a thread of its own."""

    def __init__(self) -> None:
        self._watchers: set[tuple[Callable[[], None], asyncio.AbstractEventLoop, int]] = set()

    def add(self, callback: Callable[[], None]) -> Callable[[], None]:
        entry = (callback, asyncio.get_running_loop(), threading.get_ident())
        self._watchers.add(entry)
        return lambda: self._watchers.discard(entry)

    def publish(self) -> None:
        for callback, loop, thread in list(self._watchers):
            if runs_here(loop, thread):
                callback()
            elif not loop.is_closed():
                loop.call_soon_threadsafe(callback)
