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
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import multiprocess
import orjson
import psutil

from queryqueue.driver_socket.segments import DEFAULT_THRESHOLD
from queryqueue.engine.driver import LocalQueueDriver
from queryqueue.engine.errors import QueryTimeoutError
from queryqueue.engine.outcome import encode_error
from queryqueue.engine.queue import QueryQueue
from queryqueue.engine.responses import QueueId, QueueKey
from queryqueue.engine.retrieved import RetrievedQuery
from queryqueue.engine.store import QueueStore
from queryqueue.supervisor import loops
from queryqueue.supervisor.loops import LoopChoice
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
    worker_main,
)
from queryqueue.supervisor.worker_state import Job, Worker

_log = logging.getLogger("queryqueue.pool")
SPAWN_RETRY_FIRST = 0.1
SPAWN_RETRY_MAX = 5.0


class WorkerPool:
    def __init__(
        self,
        app_ref: str,
        socket_path: str | Path,
        store: QueueStore,
        *,
        workers: int = 2,
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
        if workers < 1:
            raise ValueError("a pool needs at least one worker")
        if worker_poll_s < 0:
            raise ValueError(f"worker_poll_s must be 0 (off) or more, not {worker_poll_s!r}")
        self.worker_poll_s = worker_poll_s
        loops.loop_factory(event_loop)  # refused here, not in each worker
        self.event_loop: LoopChoice = event_loop
        self.spawn_failures = 0
        self.spawn_error: str | None = None
        self._respawn: asyncio.TimerHandle | None = None
        self._spawn_delay = SPAWN_RETRY_FIRST
        self.execution_timeout = 600.0  # the app's, once loaded
        self.app_ref = app_ref
        # What it takes back from its workers: dead ones', lost outcomes, at the stop.
        self.takeback = TakeBack(store, app_ref, max_worker_deaths)
        self.socket_path = str(socket_path)
        self.store = store
        self.size = workers
        self.heartbeat_interval = heartbeat_interval
        self.max_tasks_per_worker = max_tasks_per_worker
        self.cancel_grace = cancel_grace
        self.shm_threshold = shm_threshold
        self.max_memory_per_worker = max_memory_per_worker
        # What `describe` counts: workers killed, retired, replaced; queries handed over; reloads.
        self.terminated = self.recycled = self.replaced = self.handed_off = self.reloads = 0
        # The last query handed over was retrieved with others pending: the queue is
        # saturated, and nobody waits long for its next message (no poll for one).
        self.saturated = False
        self._context = context or multiprocess.get_context("spawn")
        self._workers: list[Worker] = []
        self._backlog: deque[Job] = deque()
        self._heartbeats: asyncio.Task[None] | None = None
        self._stopping = False
        self.reload_error: str | None = None
        self._cancelling: set[asyncio.Task[None]] = set()
        # Where the cancel handlers the workers' watches carry (`_CANCEL_HANDLER`) go: the
        # server's next batch (set by the server whose socket the workers talk to).
        self.noted: Callable[[QueueId, str], None] | None = None
        self.queue: QueryQueue | None = None
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
        # Beat as often as the app's executors would, so no held item ever looks stalled.
        options = app.queue_options
        self.heartbeat_interval = min(
            self.heartbeat_interval, float(options.get("heartbeat_interval", 30.0))
        )
        self.execution_timeout = float(options.get("execution_timeout", self.execution_timeout))
        self._fill()
        self._heartbeats = asyncio.ensure_future(self._heartbeat_forever())

    async def stop(self, grace: float = 5.0) -> None:
        """Take no more work, let the running queries finish within `grace` seconds in
        all, then end the workers (killed past it). What they held, unfinished, stays held
        until `give_back`."""
        self._stopping = True
        if self._respawn is not None:
            self._respawn.cancel()
        if self._heartbeats is not None:
            self._heartbeats.cancel()
            await asyncio.gather(self._heartbeats, return_exceptions=True)
        if self.queue is not None:
            await self.queue.close(grace=0)
        for worker in self._workers:
            self._unwatch(worker)
            with contextlib.suppress(OSError, ValueError):
                worker.conn.send_bytes(b"")  # asks the worker to finish and exit
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        for worker in self._workers:
            await loop.run_in_executor(None, worker.process.join, max(0.0, deadline - loop.time()))
            if worker.process.is_alive():
                _log.warning(
                    "worker %d still runs %s after the stop grace of %s s: killed",
                    worker.process.pid,
                    worker.job.path if worker.job else "nothing",
                    grace,
                )
                worker.process.kill()
                await loop.run_in_executor(None, worker.process.join, 10.0)
            worker.conn.close()
            held = [job for job in (worker.job, worker.next) if job is not None]
            self.takeback.unfinished += [(job.queue_id, job.path) for job in held]
        self.takeback.unfinished += [(job.queue_id, job.path) for job in self._backlog]
        self._backlog.clear()
        self._workers.clear()

    async def reload(self) -> bool:
        """Roll out new handler code: the app is imported afresh in a new interpreter
        first, and only if that works every worker finishes what it holds and retires,
        replaced by a new one that imports the new code. Nothing queued or running is
        lost. False (logged, and in `describe`) when the new code does not load: the
        workers go on with the old. The queue's options are read at start only."""
        done = await asyncio.to_thread(_loads_afresh, self.app_ref)
        if done.returncode != 0:
            self.reload_error = (done.stderr.strip().splitlines() or ["it exited"])[-1]
            _log.error(
                "reload refused: %s does not load (%s); the workers go on with the code they have",
                self.app_ref,
                self.reload_error,
            )
            return False
        self.reloads, self.reload_error = self.reloads + 1, None
        retiring = [worker for worker in self._workers if not worker.retiring]
        _log.warning(
            "reloading %s: %d workers retire after what they hold", self.app_ref, len(retiring)
        )
        for worker in retiring:
            self._retire(worker)
        return True

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
        held = len(self._backlog)
        for worker in self._workers:  # a loop, not sum() of a generator: 4 calls a query
            held += (worker.job is not None) + (worker.next is not None)
        return held

    @property
    def backlog(self) -> int:
        """Items handed to this pool that no worker has been sent yet."""
        return len(self._backlog)

    @property
    def full(self) -> bool:
        """The pool holds its queue's whole budget: the store counts at least as many
        active items, so an ADD alone cannot make anything retrievable."""
        return self.queue is not None and self.held >= self.queue.concurrency

    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    def describe(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "alive": len(self._workers),
            "spawn_failures": self.spawn_failures,
            "spawn_error": self.spawn_error,
            "workers": [w.describe(asyncio.get_running_loop().time()) for w in self._workers],
            "backlog": self.backlog,
            "handed_off": self.handed_off,
            "replaced": self.replaced,
            "terminated": self.terminated,
            "recycled": self.recycled,
            "reclaimed": len(self.takeback.reclaimed),
            "reloads": self.reloads,
            "reload_error": self.reload_error,
            "reconciles": self.queue.reconcile_runs if self.queue is not None else 0,
            "budget": {self.queue.prefix: self.queue.concurrency} if self.queue else {},
        }

    def _fill(self) -> None:
        """Spawn workers up to the pool's size. A spawn that fails (EMFILE, EAGAIN, no
        memory) is retried with backoff, and the pool says it is short meanwhile."""
        self._respawn = None
        while len(self._workers) < self.size and not self._stopping:
            try:
                self._spawn()
            except OSError as exc:
                self.spawn_failures += 1
                self.spawn_error = f"{type(exc).__name__}: {exc}"
                _log.error(
                    "worker spawn failed (%s): the pool has %d of %d workers; retrying in %.1f s",
                    self.spawn_error,
                    len(self._workers),
                    self.size,
                    self._spawn_delay,
                )
                self._respawn = asyncio.get_running_loop().call_later(self._spawn_delay, self._fill)
                self._spawn_delay = min(self._spawn_delay * 2, SPAWN_RETRY_MAX)
                return
        if self.spawn_error is not None and len(self._workers) == self.size:
            _log.warning("the pool is back to %d workers", self.size)
        self.spawn_error = None
        self._spawn_delay = SPAWN_RETRY_FIRST
        self._assign()

    def _spawn(self) -> Worker:
        parent, child = self._context.Pipe()
        try:
            process = self._context.Process(
                target=worker_main,
                args=(
                    self.app_ref,
                    self.socket_path,
                    child,
                    self.shm_threshold,
                    self.event_loop,
                    self.worker_poll_s,
                ),
                daemon=True,
            )
            process.start()
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        # Workers run queries, the supervisor coordinates them: a worker it wakes (a
        # hand-off, an ACK's answer) must not preempt it mid-turn on a busy machine, which
        # had the supervisor's writes take a sixth of its time. SCHED_BATCH never preempts
        # on wake-up; it gets its full share of the CPU otherwise.
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setscheduler(process.pid, os.SCHED_BATCH, os.sched_param(0))
        worker = Worker(process, parent)
        self._workers.append(worker)
        loop = asyncio.get_running_loop()
        loop.add_reader(parent.fileno(), self._on_message, worker)
        loop.add_reader(process.sentinel, self._on_exit, worker)
        worker.watchers = [parent.fileno(), process.sentinel]
        return worker

    def _unwatch(self, worker: Worker) -> None:
        loop = asyncio.get_running_loop()
        for fd in worker.watchers:
            loop.remove_reader(fd)
        worker.watchers = []

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
        asyncio.get_running_loop().call_soon(self._reconcile)

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
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
        assert self.queue is not None
        self.submit(self.queue.prefix, retrieved)

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
        if self._job(retrieved.queue_id) is not None:
            raise RuntimeError(f"queue item {retrieved.queue_id} is handed off already")
        path = f"{prefix}:{retrieved.query_key_hash}"
        self.saturated = saturates(retrieved)
        query = retrieved.query if isinstance(retrieved.query, dict) else {}
        added = query.get("addedToQueueTime")
        priority = query.get("priority")
        self._backlog.append(
            Job(
                retrieved.queue_id,
                path,
                job_message(retrieved),
                handler=str(query.get("queryHandler") or ""),
                query_key=_shown_key(query.get("queryKey")),
                priority=priority if isinstance(priority, int) else 0,
                added_ms=added if isinstance(added, int | float) else None,
            )
        )
        self.handed_off += 1
        self._assign()

    def job(self, key: QueueKey) -> Job | None:
        """The job of an item this pool holds (waiting or running) or whose ACK just ended
        it, by id or path."""
        held = self._job(key)
        if held is not None:
            return held
        for worker in self._workers:
            for ended in (worker.acking, worker.finished):
                if ended is not None and key in (ended.queue_id, ended.path):
                    return ended
        return None

    def holds(self, queue_id: QueueId) -> bool:
        """A job of this item waits here or runs (not one whose ACK ended it)."""
        return self._job(queue_id) is not None

    def _job(self, key: QueueKey) -> Job | None:
        for job in self._backlog:
            if key in (job.queue_id, job.path):
                return job
        for worker in self._workers:
            for held in (worker.job, worker.next):
                if held is not None and key in (held.queue_id, held.path):
                    return held
        return None

    def running(self) -> list[tuple[QueueId, float]]:
        """The queries on workers now: queue id, and when each was sent
        (`time.monotonic()`)."""
        return [
            (worker.job.queue_id, worker.job.sent_at)
            for worker in self._workers
            if worker.job is not None and worker.job.sent_at is not None
        ]

    def alive(self, queue_id: QueueId) -> bool:
        """Whether this pool holds the item for a live worker, or to hand to one: its
        heartbeats come from here, so a stale one in the store means they were late (the
        store away, a lane behind), never that its executor died (a dead worker's item is
        reclaimed at once). Its reaper leaves such an item alone (`QueryQueue.held_here`)."""
        job = self._job(queue_id)
        if job is None or job.removed_at is not None or job.timed_out:
            return False
        worker = next((w for w in self._workers if job is w.job), None)
        return worker is None or worker.process.is_alive()

    def acking(self, queue_id: QueueId) -> None:
        """The ACK of a worker's query is in a batch whose COMMIT starts now: the worker
        runs its next without waiting for that ACK's answer (`worker._WorkerLoop`), so it is sent
        it now, while the COMMIT makes its round trip, not once the batch is answered.
        Not a worker that may still run a thread of that query (its DRAINING comes once
        the ACK is answered), nor one due to retire after it."""
        limit = self.max_tasks_per_worker
        for worker in self._workers:
            job = worker.job
            if job is None or job.queue_id != queue_id:
                continue
            if (
                worker.next is not None
                or worker.acking is not None
                or worker.draining_since is not None
                or worker.retiring
            ):
                return
            if job.timed_out or (limit and worker.executed + 1 >= limit):
                return
            worker.job, worker.acking = None, job
            self._assign()
            return

    def acked(self, key: QueueKey) -> bool:
        """An ACK by `key` was answered: the ACK is the last a worker does for a query,
        so the worker whose query that is is free now, and is sent its next at once (or
        was, as the ACK's batch committed: `acking`). It says nothing more unless a
        handler thread of it still runs (`_DRAINING`). True: it was a worker's query."""
        for worker in self._workers:
            acking = worker.acking
            if acking is not None and key in (acking.queue_id, acking.path):
                worker.acking = None
                self._ended(worker, acking)
                self._retire_if_due(worker)  # its next was sent already (`acking`)
                self._assign()
                return True
            if worker.job is not None and key in (worker.job.queue_id, worker.job.path):
                self._finished(worker)
                return True
        return False

    def _finished(self, worker: Worker) -> None:
        self._ended(worker, worker.job)
        self._start_next(worker)
        self._assign()

    def _ended(self, worker: Worker, job: Job | None) -> None:
        if job is not None:
            self.takeback.succeeded(job.path)  # it ran to its end
            worker.finished = job
        worker.executed += 1

    def _start_next(self, worker: Worker) -> None:
        """The worker's query is over: what was sent it meanwhile (`next`) is its job now,
        unless the worker is due to be retired (it then leaves after that one)."""
        worker.job, worker.next = worker.next, None
        if worker.job is not None:
            worker.job.started_at = asyncio.get_running_loop().time()
        self._retire_if_due(worker)

    def _retire_if_due(self, worker: Worker) -> None:
        if self._due_to_retire(worker, quiet=False, done=0):
            self._retire(worker)

    def removed(self, key: QueueKey) -> None:
        """The item was cancelled: a worker running it hears of it now (its cancel handler
        runs within a loop turn there, not a heartbeat later); a waiting one never starts."""
        for job in list(self._backlog):
            if key in (job.queue_id, job.path):
                self._backlog.remove(job)
        for worker in self._workers:
            for held in (worker.job, worker.next):
                if held is not None and key in (held.queue_id, held.path):
                    # One sent ahead and not started is skipped by its worker.
                    with contextlib.suppress(OSError, ValueError):
                        worker.conn.send_bytes(_CANCEL + orjson.dumps(held.queue_id))

    def _assign(self) -> None:
        for worker in self._workers:
            if not self._backlog:
                return
            if not self._takes(worker):
                continue
            job = self._backlog.popleft()
            worker.job = job
            job.started_at = self._loop_time()
            job.sent_ms = time.time() * 1000
            job.sent_at = time.monotonic()
            try:
                worker.conn.send_bytes(job.blob)
            except (OSError, ValueError):
                self._backlog.appendleft(job)  # the worker died: its exit handler runs next
                worker.job = None

    def _loop_time(self) -> float:
        # Its loop kept since start: on 3.11 each get_running_loop() is a getpid() call.
        return (self._loop or asyncio.get_running_loop()).time()

    @staticmethod
    def _takes(worker: Worker) -> bool:
        # No is_alive() here (a waitpid per call, several per query): a dead worker leaves
        # `_workers` once its sentinel is read, and a hand-off sent to it before that fails
        # on its closed pipe and goes back to the backlog (`_assign`).
        return worker.job is None and worker.draining_since is None and not worker.retiring

    def _on_message(self, worker: Worker) -> None:
        try:
            message = worker.conn.recv_bytes()
        except (EOFError, OSError):
            # The pipe is closed: only the exit handler has anything left to do.
            self._unwatch(worker)
            asyncio.get_running_loop().add_reader(worker.process.sentinel, self._on_exit, worker)
            worker.watchers = [worker.process.sentinel]
            return
        kind, queue_id, text = parse_report(message)
        if kind == _CANCEL_HANDLER and queue_id is not None and text is not None:
            self.note(queue_id, text)
            return
        acking = worker.acking
        if kind == LOST and acking is not None and acking.queue_id == queue_id:
            # Its ACK, sent as its next query started, was not stored through every retry.
            worker.acking = None
            self._in_background(self.takeback.give_back(acking.queue_id))
            return
        job = worker.job
        ours = job is not None and job.queue_id == queue_id
        if kind == _TIMED_OUT and job is not None and ours and text is not None:
            # Its handler, on the worker's loop thread, did not stop at its timeout: its
            # waiters hear of it now, and the worker has the grace to finish it.
            self._in_background(self.takeback.fail_timed_out(job.queue_id, text))
        if kind in (_DRAINING, _TIMED_OUT):
            worker.draining_since = asyncio.get_running_loop().time()
            if ours:  # its ACK was not answered: it is over all the same
                worker.job = None
                worker.executed += 1
            elif job is not None:  # sent since its ACK: it waits for the thread, unstarted
                worker.job, worker.next = None, job
            return
        if kind == LOST and ours:
            assert job is not None
            self._in_background(self.takeback.give_back(job.queue_id))
        if kind in (LOST, DONE):
            if ours:
                self._finished(worker)
            elif job is None and worker.draining_since is not None:
                worker.draining_since = None  # drained: what was sent meanwhile starts now
                self._start_next(worker)
            # Else about a query whose ACK was answered already: nothing left to do.
        self._assign()

    def _due_to_retire(self, worker: Worker, *, quiet: bool, done: int = 1) -> bool:
        """Whether the worker is retired once its job is done (`done`: that job is not
        counted in `executed` yet): at its task limit, or over its memory limit."""
        limit = self.max_tasks_per_worker
        if limit and worker.executed + done >= limit:
            return True
        if self.max_memory_per_worker is None:
            return False
        try:
            rss = int(psutil.Process(worker.process.pid).memory_info().rss)
        except psutil.Error:
            return False
        if rss <= self.max_memory_per_worker:
            return False
        if not quiet:
            _log.info("worker %s uses %d bytes: recycled", worker.process.pid, rss)
        return True

    def _retire(self, worker: Worker) -> None:
        worker.retiring = True
        with contextlib.suppress(OSError, ValueError):
            worker.conn.send_bytes(b"")

    def _on_exit(self, worker: Worker) -> None:
        self._unwatch(worker)
        if worker not in self._workers:
            return  # handled already: an exited process's sentinel stays readable
        self._workers.remove(worker)
        worker.process.join(0)
        with contextlib.suppress(OSError):
            worker.conn.close()
        if worker.job is not None:  # an acknowledged one is no longer its job
            job = worker.job
            outcome = self.takeback.died(
                job.queue_id,
                job.path,
                worker.process.exitcode,
                counts=not (job.timed_out or job.abandoned),
            )
            self._in_background(self.takeback.take_back(job.queue_id, job.path, outcome))
        if worker.acking is not None:
            # It ran to its end; stored, unless the ACK's batch failed to commit and the
            # worker died before its retry: then its waiters ask again (nothing to take
            # back once it was stored, and no death counted against it).
            self._in_background(self.takeback.give_back(worker.acking.queue_id))
        if worker.next is not None:  # never started: back to the queue, run again
            self._in_background(self.takeback.give_back(worker.next.queue_id))
        if not self._stopping:
            if worker.retiring:
                self.recycled += 1
            else:
                self.replaced += 1
            self._fill()

    async def _heartbeat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            await self.beat()
            self.poke()  # also reaps orphaned and stalled items when nothing else happens

    async def beat(self) -> None:
        """One heartbeat round (a steppable loop): keep held and waiting items alive, stop
        workers that still run an item someone removed (cancelled, timed out, reaped), and
        enforce the execution timeout on workers that cannot enforce it themselves."""
        loop_time = asyncio.get_running_loop().time()
        running: list[tuple[Worker, Job]] = []
        for worker in list(self._workers):
            if await self._overdue(worker, loop_time):
                continue
            if (
                worker.draining_since is not None
                and loop_time - worker.draining_since >= self.cancel_grace
            ):
                _log.warning(
                    "worker %s still runs a finished query: terminated", worker.process.pid
                )
                self.terminated += 1
                worker.draining_since = None
                worker.process.kill()
                continue
            if worker.job is not None and worker.process.is_alive():
                running.append((worker, worker.job))
        waiting = [*self._backlog, *(w.next for w in self._workers if w.next is not None)]
        # All at once, each on a free lane: one held up (a lane still reconnecting after
        # an outage) delays no other item's heartbeat past the stall timeout.
        beaten = await asyncio.gather(
            *(self._heartbeat(job.queue_id) for _, job in running),
            *(self._heartbeat(job.queue_id) for job in waiting),
        )
        for (worker, job), kept in zip(running, beaten, strict=False):
            if kept or worker.job is not job:  # beaten, or ended meanwhile (its ACK)
                continue
            # Removed from the queue: the worker is told (its cancel handler runs there);
            # if the query has not stopped within the grace period, the process goes.
            if job.removed_at is None:
                job.removed_at = loop_time
                self.removed(job.queue_id)
            elif loop_time - job.removed_at >= self.cancel_grace:
                _log.warning(
                    "worker %s ignored the cancellation of %s: terminated",
                    worker.process.pid,
                    job.queue_id,
                )
                job.abandoned = True
                self.terminated += 1
                worker.process.kill()  # its exit handler replaces it

    async def _overdue(self, worker: Worker, loop_time: float) -> bool:
        """A query past its execution timeout and the cancel grace: the worker did not stop
        it (stopped, stuck holding the GIL): fail it for every waiter with the timeout
        error, and terminate the worker (it is replaced)."""
        job = worker.job
        if job is None or job.started_at is None or job.timed_out:
            return False
        if loop_time - job.started_at < self.execution_timeout + self.cancel_grace:
            return False
        job.timed_out = True
        _log.error(
            "worker %s ran %s past its execution timeout of %s s: terminated",
            worker.process.pid,
            job.path,
            self.execution_timeout,
        )
        await self.store.run_off_loop(
            self.store.cancel,
            job.queue_id,
            result=encode_error(
                QueryTimeoutError(
                    f"Query execution timeout after {self.execution_timeout:g} s "
                    f"(the worker did not stop it: terminated)"
                )
            ),
        )
        self.terminated += 1
        worker.process.kill()  # SIGKILL ends a stopped process too; its exit replaces it
        return True

    async def _heartbeat(self, queue_id: QueueId) -> bool:
        try:
            return await self.store.run_off_loop(self.store.heartbeat, queue_id)
        except Exception:  # a failing heartbeat must not stop the others
            _log.exception("heartbeat of queue item %s failed", queue_id)
            return True


def _shown_key(query_key: Any) -> str:
    """A query key for people to read: a string as it is, anything else as JSON."""
    if isinstance(query_key, str):
        return query_key[:200]
    try:
        return orjson.dumps(query_key).decode()[:200]
    except TypeError:
        return repr(query_key)[:200]


def _loads_afresh(app_ref: str) -> subprocess.CompletedProcess[str]:
    """Import the app in a new interpreter, in this process's directory, as a worker would."""
    script = "import sys; from queryqueue.app import load_app; load_app(sys.argv[1])"
    return subprocess.run(
        [sys.executable, "-c", script, app_ref], capture_output=True, text=True, timeout=120
    )
