"""Threads for a blocking store's commands, so that one waiting prefix stalls no other.

A store whose commands wait on the network (PostgreSQL) runs them off the event loop, on
`count` lanes: a thread each, with a connection of its own. A command of a prefix that
already has one in flight joins that prefix's lane (FIFO, so a prefix's commands keep
their order); any other goes to the least loaded lane. A prefix waiting on a lock held
elsewhere then holds up its own lane only: other prefixes, and commands addressed by
queue id, take the free ones.

Routing happens on the event loop (every call and every completion runs there), so the
bookkeeping needs no lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from queryqueue.engine.threads import settle

T = TypeVar("T")


class Lanes:
    def __init__(self, count: int, name: str) -> None:
        if count < 1:
            raise ValueError(f"a store needs at least one lane, got {count}")
        self._threads = [_Lane(f"{name}-{n}") for n in range(count)]
        self._load = [0] * count
        self._route_lane: dict[str, int] = {}
        self._route_load: dict[str, int] = {}

    @property
    def load(self) -> list[int]:
        return list(self._load)

    def pick(self, route: str | None) -> int:
        lane = self._route_lane.get(route) if route is not None else None
        if lane is None:
            lane = min(range(len(self._load)), key=self._load.__getitem__)
            if route is not None:
                self._route_lane[route] = lane
        return lane

    async def run(self, route: str | None, call: Callable[..., T], *args: Any, **kw: Any) -> T:
        lane = self.pick(route)
        self._load[lane] += 1
        if route is not None:
            self._route_load[route] = self._route_load.get(route, 0) + 1
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._threads[lane].put(
            (loop, future, functools.partial(call, *args, **kw), self._finished, (lane, route))
        )
        return await future

    def _finished(self, lane: int, route: str | None) -> None:
        self._load[lane] -= 1
        if route is not None:
            left = self._route_load[route] - 1
            if left:
                self._route_load[route] = left
            else:  # nothing of it in flight: its next command may take any lane
                del self._route_load[route]
                del self._route_lane[route]

    def shutdown(self) -> None:
        """What was handed to a lane still runs; then its thread ends."""
        for thread in self._threads:
            thread.stop()


_Work = tuple[
    asyncio.AbstractEventLoop,
    "asyncio.Future[Any]",
    Callable[[], Any],
    Callable[..., None],
    tuple[Any, ...],
]


class _Lane:
    """One thread and the calls handed to it, in order. A hand-off is a queue put, the
    way back one `call_soon_threadsafe` that counts the call done and settles its future
    (a ThreadPoolExecutor's future wrapped in the loop's took two, and ~100 us a batch
    between the loop and the lane on an idle supervisor)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._work: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def put(self, work: _Work) -> None:
        if self._thread is None:  # started by its first call
            self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
            self._thread.start()
        self._work.put(work)

    def stop(self) -> None:
        if self._thread is not None:
            self._work.put(None)
            self._thread.join()
            self._thread = None

    def _serve(self) -> None:
        while (work := self._work.get()) is not None:
            loop, future, call, finished, where = work
            outcome: tuple[Any, BaseException | None] = (None, None)
            # A caller that stopped waiting before its call started: it does not run.
            if not future.cancelled():
                try:
                    outcome = (call(), None)
                except BaseException as exc:  # delivered to the awaiting task
                    outcome = (None, exc)
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                loop.call_soon_threadsafe(_settle, future, outcome, finished, where)
            del work, loop, future, call, outcome  # nothing kept alive while idle


def _settle(
    future: asyncio.Future[Any],
    outcome: tuple[Any, BaseException | None],
    finished: Callable[..., None],
    where: tuple[Any, ...],
) -> None:
    # Counted down when the call has ended on its thread, not when the caller stops
    # waiting (a cancelled caller): until then the lane is still busy with it.
    finished(*where)
    settle(future, *outcome)


def route_of(args: tuple[Any, ...]) -> str | None:
    """The prefix a command is about, from its first argument (a path or a prefix); None
    for a queue id or no argument."""
    if args and isinstance(args[0], str):
        return args[0].rpartition(":")[0] or args[0]
    return None


class OffLoop:
    """Where a store's commands run: at once on the caller's thread, or, for a store whose
    commands may wait on the network (a database server), on threads of its own (`lanes`
    of them), never on the event loop, so a slow database stalls no other client."""

    blocking = False
    lanes = 1
    _lanes: Lanes | None = None

    async def run_off_loop(
        self, call: Callable[..., T], *args: Any, route: str | None = None, **kwargs: Any
    ) -> T:
        """`call(*args, **kwargs)` at once, or on a lane if the store is blocking: the lane
        of `route` (a prefix; by default the one named by the first argument)."""
        if not self.blocking:
            return call(*args, **kwargs)
        self._lanes = self._lanes or Lanes(self.lanes, "queryqueue-store")
        return await self._lanes.run(route or route_of(args), call, *args, **kwargs)

    def _stop_thread(self) -> None:
        lanes, self._lanes = self._lanes, None
        if lanes is not None:
            lanes.shutdown()
