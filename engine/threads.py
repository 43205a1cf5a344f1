"""Threads for sync query handlers, kept between queries.

`asyncio.to_thread` builds an executor future per call, chains it to an asyncio future
and hops through both (145 us of CPU a call in a micro-benchmark here, ~65 us for this).
Here a hand-off is a queue put (and a wake-up), the way back one `call_soon_threadsafe`.

Unlike the loop's default executor, which stops at `min(32, cpus + 4)` threads, there
is a thread for every handler running at once: a queue's concurrency is its own to set,
and a cancelled handler that Python cannot stop does not take a thread from the next.
Threads are daemons: a process leaving with a handler still running does not wait for
it (its item is reclaimed as stalled, as after any crash).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import queue
import threading
from collections.abc import Callable
from typing import Any

_Work = (
    tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", contextvars.Context, Callable[[], Any]]
    | None  # an idle thread's cue to end (close)
)


class HandlerThreads:
    def __init__(self, name: str = "queryqueue-handler") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._idle = 0
        self._closed = False
        self._work: queue.SimpleQueue[_Work] = queue.SimpleQueue()

    def close(self) -> None:
        """Idle threads end now, busy ones once their call is done (a later `run` still
        runs, on a thread that then ends)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, 0
        for _ in range(idle):
            self._work.put(None)

    def run(self, call: Callable[[], Any]) -> asyncio.Future[Any]:
        """`call()` in a thread, in a copy of this context; its outcome as a future of the
        running loop. Cancelling the future does not stop the call: its outcome is dropped."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1  # that thread is this call's: nobody else counts on it
        self._work.put((loop, future, contextvars.copy_context(), call))
        if start:
            threading.Thread(target=self._serve, name=self._name, daemon=True).start()
        return future

    def _serve(self) -> None:
        while True:
            work = self._work.get()
            if work is None:
                return
            loop, future, context, call = work
            try:
                outcome: tuple[Any, BaseException | None] = (context.run(call), None)
            except BaseException as exc:  # delivered to the awaiting task, as to_thread does
                outcome = (None, exc)
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(settle, future, *outcome)
            del work, loop, future, context, call, outcome  # nothing kept alive while idle
            with self._lock:
                if self._closed:
                    return
                self._idle += 1


def settle(future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    """A call's outcome, made on another thread, into its future (on the future's loop)."""
    if future.done():  # cancelled meanwhile
        return
    if error is None:
        future.set_result(value)
    else:
        future.set_exception(error)
