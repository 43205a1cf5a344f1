"""The pool's heartbeat round: every item it holds stays alive in the store, a query
someone removed is stopped, and the execution timeout holds on workers that cannot
enforce it themselves.

The supervisor beats for its workers, so a worker stuck in C code that holds the GIL is
never declared stalled while its process is alive; a worker that ignores its query's
removal, or runs past its timeout and the cancel grace, is killed (and replaced).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from queryqueue.engine.errors import QueryTimeoutError
from queryqueue.engine.outcome import encode_error
from queryqueue.supervisor.core.slots import Job, Worker

if TYPE_CHECKING:
    from queryqueue.supervisor.pool import WorkerPool

_log = logging.getLogger("queryqueue.pool")


class Beats:
    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    async def forever(self) -> None:
        while True:
            await asyncio.sleep(self.pool.heartbeat_interval)
            await self.beat()
            self.pool.poke()  # also reaps orphaned and stalled items when nothing else happens

    async def beat(self) -> None:
        """One heartbeat round (a steppable loop): keep held and waiting items alive, stop
        workers that still run an item someone removed (cancelled, timed out, reaped), and
        enforce the execution timeout on workers that cannot enforce it themselves."""
        now = time.monotonic()
        running: list[tuple[Worker, Job]] = []
        for worker in list(self.pool.slots.workers):
            if await self._overdue(worker, now):
                continue
            if (
                worker.draining_since is not None
                and now - worker.draining_since >= self.pool.cancel_grace
            ):
                _log.warning(
                    "worker %s still runs a finished query: terminated", worker.process.pid
                )
                self.pool.terminated += 1
                worker.draining_since = None
                worker.process.kill()
                continue
            if worker.job is not None and worker.process.is_alive():
                running.append((worker, worker.job))
        slots = self.pool.slots
        waiting = [*slots.backlog, *(w.next for w in slots.workers if w.next is not None)]
        # All at once, each on its prefix's lane (in order behind that prefix's batch): a
        # prefix whose lock another client holds holds up its own heartbeats only, never
        # the lanes other prefixes' commands and `stats` need.
        beaten = await asyncio.gather(
            *(self._heartbeat(job) for _, job in running),
            *(self._heartbeat(job) for job in waiting),
        )
        for (worker, job), kept in zip(running, beaten, strict=False):
            if kept or worker.job is not job:  # beaten, or ended meanwhile (its ACK)
                continue
            # Removed from the queue: the worker is told (its cancel handler runs there);
            # if the query has not stopped within the grace period, the process goes.
            if job.removed_at is None:
                job.removed_at = now
                self.pool.removed(job.queue_id)
            elif now - job.removed_at >= self.pool.cancel_grace:
                _log.warning(
                    "worker %s ignored the cancellation of %s: terminated",
                    worker.process.pid,
                    job.queue_id,
                )
                job.abandoned = True
                self.pool.terminated += 1
                worker.process.kill()  # its exit handler replaces it

    async def _overdue(self, worker: Worker, now: float) -> bool:
        """A query past its execution timeout and the cancel grace: the worker did not stop
        it (stopped, stuck holding the GIL): fail it for every waiter with the timeout
        error, and terminate the worker (it is replaced)."""
        job = worker.job
        if job is None or job.started_at is None or job.timed_out:
            return False
        if now - job.started_at < self.pool.execution_timeout + self.pool.cancel_grace:
            return False
        job.timed_out = True
        _log.error(
            "worker %s ran %s past its execution timeout of %s s: terminated",
            worker.process.pid,
            job.path,
            self.pool.execution_timeout,
        )
        await self.pool.store.run_off_loop(
            self.pool.store.cancel,
            job.queue_id,
            result=encode_error(
                QueryTimeoutError(
                    f"Query execution timeout after {self.pool.execution_timeout:g} s "
                    f"(the worker did not stop it: terminated)"
                )
            ),
        )
        self.pool.terminated += 1
        worker.process.kill()  # SIGKILL ends a stopped process too; its exit replaces it
        return True

    async def _heartbeat(self, job: Job) -> bool:
        store, prefix = self.pool.store, job.path.rpartition(":")[0]
        try:
            return await store.run_off_loop(store.heartbeat, job.queue_id, route=prefix)
        except Exception:  # a failing heartbeat must not stop the others
            _log.exception("heartbeat of queue item %s failed", job.queue_id)
            return True
