"""A pool worker's watch over the sync handler it runs on its loop's thread.

A worker runs one query at a time and its loop has nothing else to do meanwhile, so a
sync handler runs on the loop's thread (`Executor.watch`): no hop to a handler thread and
back, which cost two thread wake-ups a query. What the loop would have done meanwhile a
thread of the worker's own does, as long as the handler runs:

- it reads the worker's pipe: a cancellation of that query calls its cancel handler here
  (a running SQLite statement is interrupted from another thread just so) and tells the
  pool the query is over but still running (`DRAINING`: the pool takes no more of this
  worker's time than the cancel grace); anything else goes to the loop, in order;
- at the execution timeout it does the same, and has the pool fail the query for its
  waiters at once (`TIMED_OUT`), as a handler thread's timeout would;
- the cancel handler the query sets goes to the pool to record with its item
  (`CANCEL_HANDLER`), so a supervisor reclaiming it after a crash can call it.

The loop's thread never waits for this one: the watch ticks while queries come (a check
a tick, whatever their rate), and parks once none has begun for a while.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson

from queryqueue.engine.loop_run import LoopRun
from queryqueue.engine.responses import QueueId

# On a worker's pipe, each followed by JSON. From the pool:
CANCEL = b"C"  # the queue id of an item removed from the queue
# From the worker (`worker.parse_report` reads them), with the queue id of a query:
DRAINING = b"draining"  # over for the pool, but a handler of it still runs
TIMED_OUT = b"timeout"  # [queue id, outcome]: as DRAINING, and fail it with the outcome
CANCEL_HANDLER = b"canceller"  # [queue id, extra]: merge into the item's extra

_log = logging.getLogger("queryqueue.worker")
TICK = 0.02  # seconds between looks at a running query: its cancel's and timeout's delay
PARK_AFTER = 1.0  # seconds without a query begun before the watch stops ticking


class WorkerWatch:
    """The `LoopRunWatch` of a pool worker whose pipe to the pool is `conn`."""

    def __init__(
        self,
        conn: Any,
        forward: Callable[[bytes], None],
        loop: asyncio.AbstractEventLoop,
        *,
        tick: float = TICK,
        park_after: float = PARK_AFTER,
    ) -> None:
        self._conn = conn
        self._forward = forward  # on the loop: a message that is not the run's cancel
        self._loop = loop
        self._tick = tick
        self._park_after = park_after
        # Held while the run is looked at from here: once `end` has it, nothing here
        # touches the run, reads the pipe or writes to it until the next `begin`.
        self._lock = threading.Lock()
        self._run: LoopRun | None = None
        self._stopped: QueueId | None = None  # the last run stopped from here
        self._begun = 0  # runs begun: the watch parks once it stays put a while
        self.looks = 0  # at a running query, from the watch's thread
        self._parked = False
        self._closed = False
        self._eof = False
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="queryqueue-watch", daemon=True)
        self._thread.start()

    # -- on the loop's thread ---------------------------------------------------------------

    def begin(self, run: LoopRun) -> None:
        with self._lock:
            self._run, self._stopped = run, None
        self._begun += 1
        if self._parked:
            self._wake.set()

    def end(self) -> None:
        with self._lock:
            self._run = None

    def carry_cancel_handler(self, run: LoopRun, value: Any) -> bool:
        try:
            extra = orjson.dumps({"cancelHandler": value}).decode()
        except TypeError:
            return False  # not JSON: the executor records it (and says why) the usual way
        with self._lock:  # this thread may be writing to the pipe
            return self._send(CANCEL_HANDLER + orjson.dumps([run.queue_id, extra]))

    def stopped(self, queue_id: QueueId) -> bool:
        """Whether the query's run was stopped from here: the pool heard it is over (it
        is told, once its ACK is answered, that the handler ended)."""
        return self._stopped == queue_id

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._wake.set()
        self._thread.join()

    # -- on the watch's thread --------------------------------------------------------------

    def _serve(self) -> None:
        seen, quiet_since = self._begun, time.monotonic()
        while True:
            self._wake.wait(None if self._parked else self._tick)
            self._wake.clear()
            self._parked = False
            with self._lock:
                if self._closed:
                    return
                run = self._run
                if run is not None:
                    self.looks += 1
                    try:
                        self._look(run)
                    except Exception:  # this thread must outlive a bug: the next run needs it
                        _log.exception("the watch of queue item %s failed", run.queue_id)
                    continue
            if self._begun != seen:
                seen, quiet_since = self._begun, time.monotonic()
            elif time.monotonic() - quiet_since >= self._park_after:
                self._parked = True
                if self._run is not None or self._begun != seen:  # begun meanwhile
                    self._parked = False

    def _look(self, run: LoopRun) -> None:
        """(Holding the lock, the run current.) Its cancel, if it came; its timeout, if due."""
        if self._stopped == run.queue_id:
            return
        while not self._eof and self._conn.poll(0):
            try:
                message = self._conn.recv_bytes()
            except (EOFError, OSError):
                self._eof = True  # the loop's own read of the pipe sees it too, later
                break
            if message.startswith(CANCEL) and _queue_id(message[1:]) == run.queue_id:
                self._stopped = run.queue_id
                run.stop(False)
                self._send(DRAINING + orjson.dumps(run.queue_id))
                return
            self._loop.call_soon_threadsafe(self._forward, message)
        if time.monotonic() >= run.deadline:
            self._stopped = run.queue_id
            outcome = run.stop(True)
            self._send(TIMED_OUT + orjson.dumps([run.queue_id, outcome]))

    def _send(self, message: bytes) -> bool:
        try:
            self._conn.send_bytes(message)
        except (OSError, ValueError):  # the pool is gone: the loop hears it on the pipe
            return False
        return True


def _queue_id(text: bytes) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
