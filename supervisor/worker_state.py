"""The pool's record of one worker process and of a query it holds: its process and pipe,
the query it runs, the one sent ahead, the one whose ACK is committing, and its state as
`queryqueue status` shows it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import psutil

from queryqueue.engine.responses import QueueId


@dataclass(eq=False)
class Job:
    queue_id: QueueId
    path: str
    blob: bytes  # the RetrievedQuery as the worker reads it (protocol.encode_retrieved)
    removed_at: float | None = None  # when the supervisor saw the item gone from the queue
    abandoned: bool = False
    started_at: float | None = None  # loop time it was sent to a worker
    timed_out: bool = False  # failed by the supervisor's own execution timeout
    handler: str = ""
    query_key: str = ""  # as its caller named it (the path has only its hash)
    priority: int = 0
    added_ms: float | None = None  # addedToQueueTime: epoch ms it was queued
    sent_ms: float | None = None  # epoch ms it went to a worker
    # time.monotonic() it went to a worker: the loop's time is in whole ms on uvloop, too
    # coarse for a turnaround of a fraction of one (linger.py).
    sent_at: float | None = None


@dataclass(eq=False)
class Worker:
    process: Any
    conn: Any  # the supervisor's end of the worker's pipe
    job: Job | None = None
    # Sent while a handler thread of its last query still ran (`_DRAINING`): it waits in
    # the pipe, not started, until the thread ends.
    next: Job | None = None
    # The query it ended last (its ACK committed): what the ACK's metrics describe.
    finished: Job | None = None
    # Its query whose ACK is in a batch now committing (`WorkerPool.acking`): over for the
    # worker, which may run its next meanwhile; ended once the ACK is answered.
    acking: Job | None = None
    executed: int = 0
    watchers: list[int] = field(default_factory=list)
    retiring: bool = False  # asked to exit after max_tasks_per_worker
    draining_since: float | None = None  # ran out of its query but a thread still runs it

    def describe(self, loop_time: float) -> dict[str, Any]:
        """A worker as `queryqueue status` shows it: pid, state, RSS, what it runs."""
        job = self.job
        state = (
            "draining"
            if self.draining_since is not None
            else "retiring"
            if self.retiring
            else "busy"
            if job is not None
            else "idle"
        )
        try:
            rss: int | None = int(psutil.Process(self.process.pid).memory_info().rss)
        except (psutil.Error, ValueError):
            rss = None
        running = None
        if job is not None:
            started = job.started_at
            elapsed = None if started is None else loop_time - started
            running = {
                "path": job.path,
                "queue_id": job.queue_id,
                "handler": job.handler,
                "query_key": job.query_key,
                "priority": job.priority,
                "running_s": None if elapsed is None else round(elapsed, 3),
            }
        return {
            "pid": self.process.pid,
            "state": state,
            "busy": job is not None,
            "executed": self.executed,
            "rss": rss,
            "running": running,
        }
