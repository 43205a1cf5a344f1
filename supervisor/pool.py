"""The worker pool: processes that execute retrieved queries handed to the supervisor.

The supervisor owns the store, so it also watches the executions it handed out:

* a hand-off is accepted into a backlog and given to the next idle worker;
* every item held by a live worker, or waiting in the backlog, is heartbeaten by the
  supervisor itself, so a worker stuck in C code that holds the GIL is never declared
  stalled while its process is alive;
* a worker that dies is replaced at once and the item it held is reclaimed at once
  through the store (CANCEL, then the app's cancel handler), not a heartbeat timeout
  later: waiting callers get ContinueWaitError and, on retry, a fresh execution.

Workers are spawned `multiprocess` processes (`worker.py`); each runs
`QueryQueue.execute_query` with its own connection to the supervisor. A hand-off reaches
a worker as JSON over its pipe, never as a pickle: it is the query as the store holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import multiprocess
import orjson

from queryqueue.driver_socket.segments import DEFAULT_THRESHOLD
from queryqueue.engine.driver import LocalQueueDriver
from queryqueue.engine.queue import QueryQueue
from queryqueue.engine.responses import QueueId, QueueKey
from queryqueue.engine.retrieved import RetrievedQuery
from queryqueue.engine.store import QueueStore
from queryqueue.supervisor import loops
from queryqueue.supervisor.beats import Beats
from queryqueue.supervisor.core.handoff import HandOff
from queryqueue.supervisor.core.slots import Job, Send, Slots, Worker
from queryqueue.supervisor.loops import LoopChoice
from queryqueue.supervisor.processes import Processes
from queryqueue.supervisor.settings import Settings
from queryqueue.supervisor.takeback import TakeBack
from queryqueue.supervisor.watch import CANCEL as _CANCEL
from queryqueue.supervisor.watch import CANCEL_HANDLER as _CANCEL_HANDLER
from queryqueue.supervisor.watch import DRAINING as _DRAINING
from queryqueue.supervisor.watch import TIMED_OUT as _TIMED_OUT
from queryqueue.supervisor.worker import (
    DONE,
    LOST,
    job_message,
    parse_report,
    saturates,
)
from queryqueue.supervisor.worker_state import describe

_log = logging.getLogger("queryqueue.pool")


class WorkerPool:
    def __init__(
        self,
        app_ref: str,
        socket_path: str | Path,
        store: QueueStore,
        *,
        workers: int = 2,
        worker_concurrency: int | None = None,
        heartbeat_interval: float = 5.0,
        max_tasks_per_worker: int | None = None,
        cancel_grace: float = 10.0,
        shm_threshold: int | None = DEFAULT_THRESHOLD,
        max_memory_per_worker: int | None = None,
        max_worker_deaths: int = 3,
        event_loop: LoopChoice = "auto",
        context: Any = None,
        worker_poll_s: float = Settings.worker_poll_s,
    ) -> None:
        _check_sizes(workers, worker_concurrency, worker_poll_s)
        # Queries a worker process runs at once (None: the app's, once loaded).
        self._worker_concurrency, self.worker_concurrency = worker_concurrency, 1
        loops.loop_factory(event_loop)  # refused here, not in each worker
        self.event_loop: LoopChoice = event_loop
        self.worker_poll_s = worker_poll_s
        self.execution_timeout = 600.0  # the app's, once loaded
        self.app_ref = app_ref
        # What it takes back from its workers: dead ones', lost outcomes, at the stop.
        self.takeback = TakeBack(store, app_ref, max_worker_deaths)
        self.socket_path = str(socket_path)
        self.store, self.size, self.heartbeat_interval = store, workers, heartbeat_interval
        self.max_tasks_per_worker = max_tasks_per_worker
        self.cancel_grace = cancel_grace
        self.shm_threshold = shm_threshold
        self.max_memory_per_worker = max_memory_per_worker
        self.terminated = self.handed_off = 0  # what `describe` counts
        # The last query handed over was retrieved with others pending: the queue is
        # saturated, and nobody waits long for its next message (no poll for one).
        self.saturated = False
        # Its worker processes: spawned, watched, retired, replaced.
        self.processes = Processes(self, context or multiprocess.get_context("spawn"))
        # Which worker holds which query, and what waits for one (core/slots.py); the one
        # way a query reaches it, whoever retrieved it (core/handoff.py).
        self.slots = Slots()
        self.hand_off = HandOff([self])
        self._heartbeats: asyncio.Task[None] | None = None
        self.beats = Beats(self)
        self._stopping = False
        self._cancelling: set[asyncio.Task[None]] = set()
        # Where the cancel handlers the workers' watches carry (`_CANCEL_HANDLER`) go: the
        # server's next batch (set by the server whose socket the workers talk to).
        self.noted: Callable[[QueueId, str], None] | None = None
        self.queue: QueryQueue | None = None
        # The queue it runs and its app's handlers, as last loaded (None: not started).
        self.served: dict[str, frozenset[str]] | None = None
        self.budgets: dict[str, int] | None = None  # the queue it runs: its concurrency
        self._poked = False
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        from queryqueue.app import load_app

        app = load_app(self.app_ref)
        self._loop = asyncio.get_running_loop()
        # The pool's own queue, on the store itself: it reconciles for every process of
        # the pool (retrieve in priority order within the concurrency, hand off here), so
        # request processes and workers need not: no socket round trips, no re-pickling.
        self.queue = app.make_queue(
            LocalQueueDriver(self.store),
            send_process_message_fn=self._hand_off,
            process_uid=f"supervisor-{os.getpid()}",
        )
        self.queue.held_here = self.alive
        self.queue.room_here = lambda: self.room
        self.served = {self.queue.prefix: frozenset(app.query_handlers)}
        self.budgets = {self.queue.prefix: self.queue.concurrency}
        # Beat as often as the app's executors would, so no held item ever looks stalled.
        options = app.queue_options
        self.heartbeat_interval = min(
            self.heartbeat_interval, float(options.get("heartbeat_interval", 30.0))
        )
        self.execution_timeout = float(options.get("execution_timeout", self.execution_timeout))
        self.worker_concurrency = self._worker_concurrency or app.worker_concurrency
        _log.info(
            "pool of %d workers for queue %r (%d queries each at once, budget %d, handlers %s)",
            self.size, app.prefix, self.worker_concurrency, self.queue.concurrency,
            ", ".join(sorted(app.query_handlers)),
        )  # fmt: skip
        self.processes.fill()
        self._heartbeats = asyncio.ensure_future(self.beats.forever())

    async def stop(self, grace: float = 5.0) -> None:
        """Take no more work, let the running queries finish within `grace` seconds in
        all, then end the workers (killed past it). What they held, unfinished, stays held
        until `give_back`."""
        self._stopping = True
        _log.info("stopping: running queries have %s s to finish", grace)
        self.processes.stopping()
        if self._heartbeats is not None:
            self._heartbeats.cancel()
            await asyncio.gather(self._heartbeats, return_exceptions=True)
        if self.queue is not None:
            await self.queue.close(grace=0)
        await self.processes.end(grace)
        self.takeback.unfinished += [(job.queue_id, job.path) for job in self.slots.clear()]

    async def reload(self) -> bool:
        """Roll out new handler code (`Processes.reload`): False when it does not load."""
        return await self.processes.reload()

    async def give_back(self) -> None:
        """After the stop (the server gone too): what it held unfinished is pending again."""
        await self.takeback.requeue_unfinished()

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def prefix(self) -> str | None:
        """The prefix of the app whose queries this pool runs (known once started)."""
        return self.queue.prefix if self.queue is not None else None

    @property
    def held(self) -> int:
        """Items handed to this pool and not finished: waiting or running."""
        return self.slots.held

    @property
    def backlog(self) -> int:
        """Items handed to this pool that no worker has been sent yet."""
        return len(self.slots.backlog)

    @property
    def room(self) -> int:
        """Queries this pool's workers could start now (free lanes, less its backlog): all
        it retrieves, so that hosts sharing a queue share its budget by what each can run,
        none holding items in its backlog while another's workers idle."""
        return self.slots.room

    @property
    def full(self) -> bool:
        """The pool holds its queue's whole budget: the store counts at least as many
        active items, so an ADD alone cannot make anything retrievable."""
        return self.queue is not None and self.held >= self.queue.concurrency

    def pids(self) -> list[int]:
        return [w.process.pid for w in self.slots.processes()]

    def describe(self) -> dict[str, Any]:
        processes = self.processes
        workers = self.slots.processes()
        return {
            "size": self.size,
            "worker_concurrency": self.worker_concurrency,
            "alive": len(workers),
            "spawn_failures": processes.spawn_failures,
            "spawn_error": processes.spawn_error,
            "workers": [describe(w, time.monotonic()) for w in workers],
            "backlog": self.backlog,
            "handed_off": self.handed_off,
            "replaced": processes.replaced,
            "terminated": self.terminated,
            "recycled": processes.recycled,
            "reclaimed": len(self.takeback.reclaimed),
            "reloads": processes.reloads,
            "reload_error": processes.reload_error,
            "reconciles": self.queue.reconciler.runs if self.queue is not None else 0,
            "budget": {self.queue.prefix: self.queue.concurrency} if self.queue else {},
        }

    # -- hand-offs --------------------------------------------------------------------------

    def poke(self, freed: bool = True) -> None:
        """Something changed in the queue (an ADD or ACK committed): reconcile soon. Pokes
        in one loop iteration make one reconcile; the queue's single flight does the rest.

        `freed=False` (an ADD): while the pool itself holds `concurrency` items, the store
        counts at least as many active, so nothing could be retrieved: no reconcile."""
        if self._poked or self.queue is None or self._stopping:
            return
        if not freed and self.full:
            return
        self._poked = True
        (self._loop or asyncio.get_running_loop()).call_soon(self._reconcile)

    def in_background(self, work: Coroutine[Any, Any, None]) -> None:
        """A give-back or take-back, kept until done (and cancelled at stop)."""
        task = asyncio.ensure_future(work)
        self._cancelling.add(task)
        task.add_done_callback(self._cancelling.discard)

    def note(self, queue_id: QueueId, extra: str) -> None:
        """Merge `extra` into the item, in the server's next batch."""
        if self.noted is not None:
            self.noted(queue_id, extra)

    def _reconcile(self) -> None:
        self._poked = False
        if self.queue is not None and not self._stopping:
            task = asyncio.ensure_future(self.queue.reconcile_queue())
            self._cancelling.add(task)
            task.add_done_callback(self._reconciled)

    def _reconciled(self, task: asyncio.Task[None]) -> None:
        self._cancelling.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            # The store away: the next ADD, ACK or heartbeat round reconciles again.
            _log.warning("reconciling the pool's queue failed: %s", exc)

    async def _hand_off(self, retrieved: RetrievedQuery) -> None:
        """What the pool's own reconcile retrieved: handed off as every source's is."""
        assert self.queue is not None
        self.hand_off.give(self.queue.prefix, retrieved)

    def submit(self, prefix: str, retrieved: RetrievedQuery) -> None:
        """Accept a hand-off: it runs on the next idle worker."""
        # The pool's queue never sees other processes' stream items: the store hides
        # EXCLUSIVE items from other process ids.
        if retrieved.persistent:
            raise RuntimeError("a stream query runs in the process that asked for it")
        if self._stopping:
            # Retrieved for the pool as it stops: given back with what it held.
            path = f"{prefix}:{retrieved.query_key_hash}"
            self.takeback.unfinished.append((retrieved.queue_id, path))
            raise RuntimeError("the worker pool is stopping")
        if self.slots.holding(retrieved.queue_id) is not None:
            raise RuntimeError(f"queue item {retrieved.queue_id} is handed off already")
        path = f"{prefix}:{retrieved.query_key_hash}"
        self.saturated = saturates(retrieved)
        query = retrieved.query if isinstance(retrieved.query, dict) else {}
        added = query.get("addedToQueueTime")
        priority = query.get("priority")
        job = Job(
            retrieved.queue_id,
            path,
            job_message(retrieved),
            handler=str(query.get("queryHandler") or ""),
            query_key=_shown_key(query.get("queryKey")),
            priority=priority if isinstance(priority, int) else 0,
            added_ms=added if isinstance(added, int | float) else None,
        )
        self.handed_off += 1
        self.send(self.slots.submit(job))

    def job(self, key: QueueKey) -> Job | None:
        """The job of an item this pool holds (waiting or running) or whose ACK just ended
        it, by id or path."""
        return self.slots.job(key)

    def holds(self, queue_id: QueueId) -> bool:
        """A job of this item waits here or runs (not one whose ACK ended it)."""
        return self.slots.holding(queue_id) is not None

    def running(self) -> list[tuple[QueueId, float]]:
        """The queries on workers now: queue id, and when each was sent
        (`time.monotonic()`)."""
        return self.slots.running()

    def alive(self, queue_id: QueueId) -> bool:
        """Whether this pool holds the item for a live worker, or to hand to one: its
        heartbeats come from here, so a stale one in the store means they were late (the
        store away, a lane behind), never that its executor died (a dead worker's item is
        reclaimed at once). Its reaper leaves such an item alone (`QueryQueue.held_here`)."""
        job = self.slots.holding(queue_id)
        if job is None or job.removed_at is not None or job.timed_out:
            return False
        worker = next((w for w in self.slots.workers if job is w.job), None)
        return worker is None or worker.process.is_alive()

    def acking(self, queue_id: QueueId) -> None:
        """The ACK of a worker's query is in a batch whose COMMIT starts now: the worker
        runs its next without waiting for that ACK's answer (`worker._WorkerLoop`), so it
        is sent it now, while the COMMIT makes its round trip (`Slots.acking`)."""
        self.send(self.slots.acking(queue_id, self.max_tasks_per_worker))

    def acked(self, key: QueueKey) -> bool:
        """An ACK by `key` was answered: the worker whose query that is is free now, and
        is sent its next at once (or was, as the ACK's batch committed: `acking`). It says
        nothing more unless a handler thread of it still runs (`_DRAINING`). True: it was
        a worker's query."""
        acked = self.slots.acked(key)
        if acked is None:
            return False
        self._moved_on(*acked)
        return True

    def _moved_on(self, worker: Worker, started: Job | None, *, ended: bool = True) -> None:
        """The worker ended a query (`ended`: its `finished`, which ran to its end) and
        started what was sent it meanwhile (`started`); retired if due, and the backlog
        assigned."""
        if ended and worker.finished is not None:
            self.takeback.succeeded(worker.finished.path)
        if started is not None:
            started.started_at = time.monotonic()
        self.processes.retire_if_due(worker)
        self.send(self.slots.assign())

    def fence(self) -> int:
        """This host's lease lapsed: stop what its workers run, before another host may
        take it over (`core/lease_watch.py`). A worker process running a query is killed;
        its exit gives each of its queries back once the store answers (here, or gone:
        another host reaped it), with no death counted against it. Queries waiting for a
        worker are given back the same way. Returns how many it stopped."""
        stopped = 0
        for job in self.slots.drop_backlog():
            self.in_background(self.takeback.give_back(job.queue_id))
            stopped += 1
        for process in self.slots.processes():
            running = [lane.job for lane in process.lanes if lane.job is not None]
            sent = sum(lane.next is not None for lane in process.lanes)  # given back on exit
            if (running or sent) and process.process.is_alive():
                for job in running:
                    job.fenced = True
                process.process.kill()
                stopped += len(running) + sent
        return stopped

    def removed(self, key: QueueKey) -> None:
        """The item was cancelled: a worker running it hears of it now (its cancel handler
        runs within a loop turn there, not a heartbeat later); a waiting one never starts."""
        for worker, held in self.slots.removed(key):
            # One sent ahead and not started is skipped by its worker.
            with contextlib.suppress(OSError, ValueError):
                worker.conn.send_bytes(_CANCEL + orjson.dumps(held.queue_id))

    def send(self, sends: list[Send]) -> None:
        """Each query to its worker's pipe, stamped as sent."""
        for worker, job in sends:
            job.started_at = job.sent_at = time.monotonic()
            job.sent_ms = time.time() * 1000
            try:
                worker.conn.send_bytes(job.blob)
            except (OSError, ValueError):
                self.slots.unsent(worker, job)  # it died: its exit handler runs next

    def heard(self, worker: Worker) -> None:
        """The worker's pipe has a report: act on it."""
        try:
            message = worker.conn.recv_bytes()
        except (EOFError, OSError):
            # The pipe is closed: only the exit handler has anything left to do.
            self.processes.unwatch(worker)
            loop = asyncio.get_running_loop()
            loop.add_reader(worker.process.sentinel, self.processes.exited, worker)
            worker.watchers = [worker.process.sentinel]
            return
        kind, queue_id, text = parse_report(message)
        worker = self.slots.lane_of(worker, queue_id)
        if kind == _CANCEL_HANDLER and queue_id is not None and text is not None:
            self.note(queue_id, text)
            return
        acking = worker.acking
        if kind == LOST and acking is not None and acking.queue_id == queue_id:
            # Its ACK, sent as its next query started, was not stored through every retry.
            worker.acking = None
            self.in_background(self.takeback.give_back(acking.queue_id))
            return
        job = worker.job
        ours = job is not None and job.queue_id == queue_id
        if kind == _TIMED_OUT and job is not None and ours and text is not None:
            # Its handler, on the worker's loop thread, did not stop at its timeout: its
            # waiters hear of it now, and the worker has the grace to finish it.
            self.in_background(self.takeback.fail_timed_out(job.queue_id, text))
        if kind in (_DRAINING, _TIMED_OUT):
            self.slots.drain(worker, queue_id, time.monotonic())
            return
        if kind == LOST and ours:
            assert job is not None
            self.in_background(self.takeback.give_back(job.queue_id))
        if kind in (LOST, DONE):
            # A lane freed without an ACK's batch, which would have retrieved its next:
            # the reconcile does (a pool retrieves only what its lanes can start).
            if ours:
                self._moved_on(worker, self.slots.finish(worker))
                self.poke()
                return
            if job is None and worker.draining_since is not None:
                # Drained: what was sent meanwhile starts now.
                self._moved_on(worker, self.slots.drained(worker), ended=False)
                self.poke()
                return
            # Else about a query whose ACK was answered already: nothing left to do.
        self.send(self.slots.assign())


def _check_sizes(workers: int, worker_concurrency: int | None, worker_poll_s: float) -> None:
    if workers < 1:
        raise ValueError("a pool needs at least one worker")
    if worker_concurrency is not None and worker_concurrency < 1:
        raise ValueError(f"worker_concurrency must be 1 or more, not {worker_concurrency!r}")
    if worker_poll_s < 0:
        raise ValueError(f"worker_poll_s must be 0 (off) or more, not {worker_poll_s!r}")


def _shown_key(query_key: Any) -> str:
    """A query key for people to read: a string as it is, anything else as JSON."""
    if isinstance(query_key, str):
        return query_key[:200]
    try:
        return orjson.dumps(query_key).decode()[:200]
    except TypeError:
        return repr(query_key)[:200]


def pools_described(described: list[dict[str, Any]]) -> dict[str, Any]:
    """`stats`' view of a supervisor's pools: one pool's as it is; several summed into
    one ("pool": workers, budgets and counters of all), each also on its own ("pools")."""
    if len(described) == 1:
        return {"pool": described[0]}
    merged: dict[str, Any] = {"workers": [], "budget": {}}
    for one in described:
        for key, value in one.items():
            if key == "workers":
                merged["workers"] += value
            elif key == "budget":
                merged["budget"].update(value)
            elif isinstance(value, int | float) and not isinstance(value, bool):
                merged[key] = merged.get(key, 0) + value
            elif merged.get(key) is None:
                merged[key] = value
    return {"pool": merged, "pools": described}
