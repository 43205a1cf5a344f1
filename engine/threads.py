"""Threads for sync query handlers, kept between queries.

`asyncio.to_thread` builds an executor future per call, chains it to an asyncio future
and hops through both (145 us of CPU a call in a micro-benchmark here, ~65 us for this).
Here a hand-off is a queue put (and a wake-up), the way back one `call_soon_threadsafe`.

Unlike the loop's default executor, which stops at `min(32, cpus + 4)` threads, there
is a thread for every handler running at once: a queue's concurrency is its own to set,
and a cancelled handler that Python cannot stop does not take a thread from the next.
Threads are daemons: a process leaving with a handler still running does not wait for
it (its item is reclaimed as stalled, as after any crash).

A caller whose loop has nothing else to do meanwhile (a pool's worker runs one query at a
time) may wait for a quick call on the spot (`run(..., within=)`): the outcome comes back
through a queue the loop's thread blocks on instead of through the loop's wake-up. A
no-op sync handler's execution took 286 us of CPU that way and takes 178 now (an async
handler's: 173; `benchmarks.executor_bench`). A slower call is delivered as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import queue
import threading
from collections.abc import Callable
from typing import Any

_Outcome = tuple[Any, BaseException | None]


class _Rendezvous:
    """Where a call's outcome waits for a caller blocked on it, while that caller waits:
    once it has stopped waiting, the outcome goes through the loop instead."""

    __slots__ = ("_box", "_lock", "_waiting")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting = True
        self._box: queue.SimpleQueue[_Outcome] = queue.SimpleQueue()

    def offer(self, outcome: _Outcome) -> bool:
        """From the call's thread: True if the waiting caller takes the outcome."""
        with self._lock:
            if self._waiting:
                self._box.put(outcome)
            return self._waiting

    def wait(self, seconds: float) -> _Outcome | None:
        """From the caller's thread: the outcome, or None once `seconds` passed without it
        (then it never comes here)."""
        try:
            return self._box.get(timeout=seconds)
        except queue.Empty:
            pass
        with self._lock:
            self._waiting = False
        try:  # offered between the timeout and the flag
            return self._box.get_nowait()
        except queue.Empty:
            return None


_Work = (
    tuple[
        asyncio.AbstractEventLoop,
        "asyncio.Future[Any]",
        contextvars.Context,
        Callable[[], Any],
        _Rendezvous | None,
    ]
    | None  # an idle thread's cue to end (close)
)


class HandlerThreads:
    def __init__(self, name: str = "queryqueue-handler") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._idle = 0
        self._closed = False
        self._work: queue.SimpleQueue[_Work] = queue.SimpleQueue()

    @property
    def idle(self) -> int:
        """Threads waiting for a call."""
        return self._idle

    def close(self) -> None:
        """Idle threads end now, busy ones once their call is done (a later `run` still
        runs, on a thread that then ends)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, 0
        for _ in range(idle):
            self._work.put(None)

    def run(self, call: Callable[[], Any], *, within: float = 0.0) -> asyncio.Future[Any]:
        """`call()` in a thread, in a copy of this context; its outcome as a future of the
        running loop. Cancelling the future does not stop the call: its outcome is dropped.

        With `within`, this thread (the loop's) blocks up to that many seconds for the
        outcome, and the future is done on return if the call was: only for a caller whose
        loop has nothing else to do meanwhile."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        rendezvous = _Rendezvous() if within > 0 else None
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1  # that thread is this call's: nobody else counts on it
        self._work.put((loop, future, contextvars.copy_context(), call, rendezvous))
        if start:
            threading.Thread(target=self._serve, name=self._name, daemon=True).start()
        if rendezvous is not None:
            outcome = rendezvous.wait(within)
            if outcome is not None:
                settle(future, *outcome)
        return future

    def _serve(self) -> None:
        while True:
            work = self._work.get()
            if work is None:
                return
            loop, future, context, call, rendezvous = work
            try:
                outcome: _Outcome = (context.run(call), None)
            except BaseException as exc:  # delivered to the awaiting task, as to_thread does
                outcome = (None, exc)
            if rendezvous is None or not rendezvous.offer(outcome):
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                    loop.call_soon_threadsafe(settle, future, *outcome)
            del work, loop, future, context, call, outcome, rendezvous  # nothing kept alive
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


class ThreadedCalls:
    """How many calls run on handler threads now, and a wait until none does (or none
    under a `key`): a call cancelled or timed out still runs (Python cannot stop a
    thread), and a process that ends waits for such calls first."""

    def __init__(self) -> None:
        self._done = threading.Condition(threading.Lock())
        self.running = 0
        self._keys: dict[Any, int] = {}

    def call(self, function: Callable[..., Any], *args: Any, key: Any = None) -> Any:
        with self._done:
            self.running += 1
            if key is not None:
                self._keys[key] = self._keys.get(key, 0) + 1
        try:
            return function(*args)
        finally:
            with self._done:
                self.running -= 1
                if key is not None:
                    self._keys[key] -= 1
                    if not self._keys[key]:
                        del self._keys[key]
                        self._done.notify_all()
                if not self.running:
                    self._done.notify_all()

    def runs(self, key: Any) -> bool:
        """Whether a call under `key` still runs."""
        with self._done:
            return key in self._keys

    def wait_for_none(self, timeout: float | None = None, key: Any = None) -> bool:
        """Block until no call runs (under `key`, if given); False on timeout."""
        with self._done:
            if key is None:
                return self._done.wait_for(lambda: not self.running, timeout)
            return self._done.wait_for(lambda: key not in self._keys, timeout)
