"""The pool's worker processes: spawned up to its size, watched (their pipe and their
exit), retired when due (a task or memory limit, a reload), replaced when they die.

A spawn that fails (EMFILE, EAGAIN, no memory) is retried with backoff while the pool
says it is short. A reload imports the app afresh in a new interpreter first; only if
that works does every worker finish what it holds and retire.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import orjson
import psutil

from queryqueue.supervisor.core.slots import Worker
from queryqueue.supervisor.worker import worker_main

if TYPE_CHECKING:
    from queryqueue.engine.queue import QueryQueue
    from queryqueue.supervisor.pool import WorkerPool

_log = logging.getLogger("queryqueue.pool")
SPAWN_RETRY_FIRST = 0.1
SPAWN_RETRY_MAX = 5.0


class Processes:
    def __init__(self, pool: WorkerPool, context: Any) -> None:
        self.pool = pool
        self.context = context
        # What `describe` counts: spawns failed, workers retired and replaced, reloads.
        self.spawn_failures = self.recycled = self.replaced = self.reloads = 0
        self.spawn_error: str | None = None
        self.reload_error: str | None = None
        self._respawn: asyncio.TimerHandle | None = None
        self._spawn_delay = SPAWN_RETRY_FIRST

    def stopping(self) -> None:
        if self._respawn is not None:
            self._respawn.cancel()

    def fill(self) -> None:
        """Spawn workers up to the pool's size. A spawn that fails (EMFILE, EAGAIN, no
        memory) is retried with backoff, and the pool says it is short meanwhile."""
        self._respawn = None
        while len(self.pool.slots.processes()) < self.pool.size and not self.pool.stopping:
            try:
                self.spawn()
            except OSError as exc:
                self.spawn_failures += 1
                self.spawn_error = f"{type(exc).__name__}: {exc}"
                _log.error(
                    "worker spawn failed (%s): the pool has %d of %d workers; retrying in %.1f s",
                    self.spawn_error,
                    len(self.pool.slots.processes()),
                    self.pool.size,
                    self._spawn_delay,
                )
                self._respawn = asyncio.get_running_loop().call_later(self._spawn_delay, self.fill)
                self._spawn_delay = min(self._spawn_delay * 2, SPAWN_RETRY_MAX)
                return
        if self.spawn_error is not None and len(self.pool.slots.processes()) == self.pool.size:
            _log.warning("the pool is back to %d workers", self.pool.size)
        self.spawn_error = None
        self._spawn_delay = SPAWN_RETRY_FIRST
        self.pool.send(self.pool.slots.assign())
        self.pool.poke()  # new lanes: retrieve what they can start

    def spawn(self) -> Worker:
        parent, child = self.context.Pipe()
        try:
            process = self.context.Process(
                target=worker_main,
                args=(
                    self.pool.app_ref,
                    self.pool.socket_path,
                    child,
                    self.pool.shm_threshold,
                    self.pool.event_loop,
                    self.pool.worker_poll_s if self.pool.worker_concurrency == 1 else 0.0,
                    self.pool.worker_concurrency,
                    _orphan_grace(self.pool.store.host_timeout, self.pool.queue),
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
        _log.info("worker %s started", process.pid)
        worker = self.pool.slots.add(process, parent, self.pool.worker_concurrency)
        loop = asyncio.get_running_loop()
        loop.add_reader(parent.fileno(), self.pool.heard, worker)
        loop.add_reader(process.sentinel, self.exited, worker)
        worker.watchers = [parent.fileno(), process.sentinel]
        return worker

    def unwatch(self, worker: Worker) -> None:
        loop = asyncio.get_running_loop()
        for fd in worker.watchers:
            loop.remove_reader(fd)
        worker.watchers = []

    def due_to_retire(self, worker: Worker, *, quiet: bool, done: int = 1) -> bool:
        """Whether the worker is retired once its job is done (`done`: that job is not
        counted in `executed` yet): at its task limit, or over its memory limit."""
        limit = self.pool.max_tasks_per_worker
        if limit and self.pool.slots.executed(worker) + done >= limit:
            return True
        if self.pool.max_memory_per_worker is None:
            return False
        try:
            rss = int(psutil.Process(worker.process.pid).memory_info().rss)
        except psutil.Error:
            return False
        if rss <= self.pool.max_memory_per_worker:
            return False
        if not quiet:
            _log.info("worker %s uses %d bytes: recycled", worker.process.pid, rss)
        return True

    def retire(self, worker: Worker) -> None:
        if worker.retiring:
            return  # asked already (another lane of its process)
        self.pool.slots.retire(worker)
        with contextlib.suppress(OSError, ValueError):
            worker.conn.send_bytes(b"")

    def exited(self, worker: Worker) -> None:
        """The worker's process ended: take back what it held, replace it."""
        self.unwatch(worker)
        if not self.pool.slots.leave(worker):
            return  # handled already: an exited process's sentinel stays readable
        worker.process.join(0)
        with contextlib.suppress(OSError):
            worker.conn.close()
        for lane in worker.lanes:
            self._take_back(lane)
        if not self.pool.stopping:
            pid, code = worker.process.pid, worker.process.exitcode
            if worker.retiring:
                _log.info("worker %s retired (a task or memory limit, a reload): replaced", pid)
                self.recycled += 1
            else:
                _log.warning("worker %s exited with %s: replaced", pid, code)
                self.replaced += 1
            self.fill()

    def _take_back(self, lane: Worker) -> None:
        """What a lane of an exited process held: each query taken back on its own."""
        takeback, exitcode = self.pool.takeback, lane.process.exitcode
        if lane.job is not None:  # an acknowledged one is no longer its job
            job = lane.job
            counts = not (job.timed_out or job.abandoned)
            outcome = (
                takeback.fenced(job.queue_id)
                if job.fenced
                else takeback.died(job.queue_id, job.path, exitcode, counts=counts)
            )
            self.pool.in_background(takeback.take_back(job.queue_id, job.path, outcome))
        if lane.acking is not None:
            # It ran to its end; stored, unless the ACK's batch failed to commit and the
            # worker died before its retry: then its waiters ask again (nothing to take
            # back once it was stored, and no death counted against it).
            self.pool.in_background(takeback.give_back(lane.acking.queue_id))
        if lane.next is not None:  # never started: back to the queue, run again
            self.pool.in_background(takeback.give_back(lane.next.queue_id))

    def retire_if_due(self, worker: Worker) -> None:
        if self.due_to_retire(worker, quiet=False, done=0):
            self.retire(worker)

    async def reload(self) -> bool:
        """Roll out new handler code: the app is imported afresh in a new interpreter
        first, and only if that works every worker finishes what it holds and retires,
        replaced by a new one that imports the new code. Nothing queued or running is
        lost. False (logged, and in `describe`) when the new code does not load: the
        workers go on with the old. The queue's options are read at start only."""
        done = await asyncio.to_thread(_loads_afresh, self.pool.app_ref)
        if done.returncode != 0:
            self.reload_error = (done.stderr.strip().splitlines() or ["it exited"])[-1]
            _log.error(
                "reload refused: %s does not load (%s); the workers go on with the code they have",
                self.pool.app_ref,
                self.reload_error,
            )
            return False
        self.reloads, self.reload_error = self.reloads + 1, None
        with contextlib.suppress(ValueError, IndexError):  # its handlers, as it printed them
            handlers = frozenset(orjson.loads(done.stdout.strip().splitlines()[-1]))
            if self.pool.prefix is not None:
                self.pool.served = {self.pool.prefix: handlers}
        retiring = [worker for worker in self.pool.slots.processes() if not worker.retiring]
        _log.warning(
            "reloading %s: %d workers retire after what they hold", self.pool.app_ref, len(retiring)
        )
        for worker in retiring:
            self.retire(worker)
        return True

    async def end(self, grace: float) -> None:
        """The pool stops: every worker asked to finish and exit, killed past `grace`."""
        workers = self.pool.slots.processes()
        for worker in workers:
            self.unwatch(worker)
            with contextlib.suppress(OSError, ValueError):
                worker.conn.send_bytes(b"")  # asks the worker to finish and exit
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        for worker in workers:
            await loop.run_in_executor(None, worker.process.join, max(0.0, deadline - loop.time()))
            if worker.process.is_alive():
                held = [lane.job.path for lane in worker.lanes if lane.job is not None]
                _log.warning(
                    "worker %d still runs %s after the stop grace of %s s: killed",
                    worker.process.pid,
                    ", ".join(held) or "nothing",
                    grace,
                )
                worker.process.kill()
                await loop.run_in_executor(None, worker.process.join, 10.0)
            worker.conn.close()


def _loads_afresh(app_ref: str) -> subprocess.CompletedProcess[str]:
    """Import the app in a new interpreter, in this process's directory, as a worker would."""
    script = (
        "import sys, json; from queryqueue.app import load_app;"
        " print(json.dumps(sorted(load_app(sys.argv[1]).query_handlers)))"
    )
    return subprocess.run(
        [sys.executable, "-c", script, app_ref], capture_output=True, text=True, timeout=120
    )


def _orphan_grace(host_timeout: float | None, queue: QueryQueue | None) -> float | None:
    """How long a worker whose supervisor died goes on with its queries: to their end on
    a store one host owns (their ACKs wait for a supervisor back on the socket); on one
    several hosts share, half the host's lease (or of its queries' stall timeout, if
    shorter), so that the worker is gone before another host reaps those queries and
    runs them again: never two executions of one at once."""
    if host_timeout is None:
        return None
    if queue is not None:
        host_timeout = min(host_timeout, queue.connection.heartbeat_timeout_ms / 1000)
    return host_timeout / 2
