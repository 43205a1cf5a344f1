"""Many deadlines behind one timer: a client's requests waiting for their answers, the
supervisor's parked long polls waiting for their ACKs. A timer handle made and cancelled
per wait was a cost of every query (and a thousand of them of a dedup storm)."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")


class Deadlines(Generic[K]):
    """(loop time, order, key) in a heap, one timer armed for the earliest; `expire(key)`
    at a key's deadline if it is still `live(key)`. A key whose wait ended first stays in
    the heap and is skipped when its time comes; once such entries dominate, the heap
    keeps only live ones (amortized: the next compaction waits for as many pushes again)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        expire: Callable[[K], None],
        live: Callable[[K], bool],
    ) -> None:
        self._loop = loop
        self._expire, self._live = expire, live
        self._heap: list[tuple[float, int, K]] = []
        self._order = itertools.count()
        self._compact_at = 1024
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    def __len__(self) -> int:
        """Deadlines kept: pending, or passed over and not yet compacted away."""
        return len(self._heap)

    def add(self, key: K, seconds: float) -> None:
        at = self._loop.time() + seconds
        if len(self._heap) >= self._compact_at:
            self._heap = [entry for entry in self._heap if self._live(entry[2])]
            heapq.heapify(self._heap)
            self._compact_at = 4 * len(self._heap) + 1024
        heapq.heappush(self._heap, (at, next(self._order), key))
        if self._timer is None or at < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._timer_at = self._loop.call_at(at, self._fire), at

    def _fire(self) -> None:
        self._timer = None
        now = self._loop.time()
        heap = self._heap
        while heap and heap[0][0] <= now:
            key = heapq.heappop(heap)[2]
            if self._live(key):
                self._expire(key)
        if heap:
            self._timer_at = heap[0][0]
            self._timer = self._loop.call_at(self._timer_at, self._fire)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
