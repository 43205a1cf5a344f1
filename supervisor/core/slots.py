"""The worker pool's state: which worker holds which query, what waits for a worker, and
what each worker is doing (its `Phase`).

Plain objects, no processes, pipes or clocks: the pool (pool.py) tells `Slots` what
happened (a hand-off, an ACK committing or answered, a worker's report, its exit) and
carries out what it decides: each `Send` is a query for a worker's pipe. A `Worker` is
one lane of a worker process, a process running N queries at once has N lanes sharing its
process and pipe (`lanes`). A lane holds at most one query running (`job`), one whose ACK
is committing while it runs the next (`acking`), and one sent while a thread of its last
query still ran (`next`).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from queryqueue.engine.responses import QueueId, QueueKey


@dataclass(eq=False)
class Job:
    queue_id: QueueId
    path: str
    blob: bytes  # the RetrievedQuery as the worker reads it (protocol.encode_retrieved)
    removed_at: float | None = None  # when the supervisor saw the item gone from the queue
    abandoned: bool = False
    started_at: float | None = None  # time.monotonic() it started on a worker
    timed_out: bool = False  # failed by the supervisor's own execution timeout
    fenced: bool = False  # stopped because this host's lease lapsed (lease_watch.py)
    handler: str = ""
    query_key: str = ""  # as its caller named it (the path has only its hash)
    priority: int = 0
    added_ms: float | None = None  # addedToQueueTime: epoch ms it was queued
    sent_ms: float | None = None  # epoch ms it went to a worker
    sent_at: float | None = None  # time.monotonic() it went to a worker (linger.py)

    def named(self, key: QueueKey) -> bool:
        return key == self.queue_id or key == self.path


class Phase(enum.Enum):
    """What a worker is doing, as `queryqueue status` shows it."""

    IDLE = "idle"  # takes the next query
    BUSY = "busy"  # runs one
    DRAINING = "draining"  # its query is over, a thread of it still runs: takes none
    RETIRING = "retiring"  # asked to exit once what it holds is done: takes none


@dataclass(eq=False)
class Worker:
    """One lane of a worker process: one query at a time. Every lane of a process shares
    its handles, its `lanes` list (the first lane stands for the process) and its fate:
    retired, exited or killed together."""

    process: Any  # the pool's handles, never touched here
    conn: Any  # the supervisor's end of the worker's pipe
    job: Job | None = None
    # Sent while a handler thread of its last query still ran (DRAINING): it waits in
    # the pipe, not started, until the thread ends.
    next: Job | None = None
    # The query it ended last (its ACK committed): what the ACK's metrics describe.
    finished: Job | None = None
    # Its query whose ACK is in a batch now committing (`Slots.acking`): over for the
    # worker, which may run its next meanwhile; ended once the ACK is answered.
    acking: Job | None = None
    executed: int = 0
    watchers: list[int] = field(default_factory=list)
    retiring: bool = False  # asked to exit after what it holds
    draining_since: float | None = None  # ran out of its query but a thread still runs it
    lanes: list[Worker] = field(default_factory=list, repr=False)  # its process's, shared

    def __post_init__(self) -> None:
        if not self.lanes:
            self.lanes.append(self)

    @property
    def phase(self) -> Phase:
        if self.draining_since is not None:
            return Phase.DRAINING
        if self.retiring:
            return Phase.RETIRING
        return Phase.IDLE if self.job is None else Phase.BUSY

    def takes(self) -> bool:
        # No is_alive() here (a waitpid per call, several per query): a dead worker leaves
        # the pool once its sentinel is read, and a query sent to it before that fails on
        # its closed pipe and goes back to the backlog (`Slots.unsent`).
        return self.job is None and self.draining_since is None and not self.retiring

    def held(self) -> tuple[Job | None, Job | None]:
        """What it holds unfinished: its running query and the one sent ahead."""
        return self.job, self.next


Send = tuple[Worker, Job]


class Slots:
    def __init__(self) -> None:
        self.workers: list[Worker] = []  # every lane of every process
        self.backlog: deque[Job] = deque()
        self._one_lane_each = True  # no process has more: the backlog goes in lane order
        # What `holding` finds by queue id: every job in the backlog or a lane's job or next.
        self._held: dict[QueueId, Job] = {}

    def add(self, process: Any, conn: Any, lanes: int = 1) -> Worker:
        """A worker process running up to `lanes` queries at once: its first lane, which
        stands for it."""
        first = Worker(process, conn)
        for _ in range(lanes - 1):
            first.lanes.append(Worker(process, conn, lanes=first.lanes))
        self.workers += first.lanes
        self._one_lane_each = self._one_lane_each and lanes == 1
        return first

    def processes(self) -> list[Worker]:
        """The first lane of each worker process."""
        return [worker for worker in self.workers if worker.lanes[0] is worker]

    @staticmethod
    def executed(worker: Worker) -> int:
        """Queries the worker's process ended, over all its lanes."""
        return sum(lane.executed for lane in worker.lanes)

    @staticmethod
    def retire(worker: Worker) -> None:
        """Its process takes no more: every lane finishes what it holds."""
        for lane in worker.lanes:
            lane.retiring = True

    @staticmethod
    def lane_of(worker: Worker, queue_id: QueueId | None) -> Worker:
        """The lane of the worker's process that holds `queue_id` (its first: none does)."""
        if len(worker.lanes) > 1:
            for lane in worker.lanes:
                for held in (lane.job, lane.acking, lane.next):
                    if held is not None and held.queue_id == queue_id:
                        return lane
        return worker

    @property
    def held(self) -> int:
        """Queries handed to the pool and not finished: waiting or running."""
        held = len(self.backlog)
        for worker in self.workers:  # a loop, not sum() of a generator: 4 calls a query
            held += (worker.job is not None) + (worker.next is not None)
        return held

    @property
    def room(self) -> int:
        """Queries the pool could start now: its lanes that take one, less its backlog."""
        free = 0
        for worker in self.workers:
            free += worker.takes()
        return max(0, free - len(self.backlog))

    def holding(self, key: QueueKey) -> Job | None:
        """The job of an item the pool holds, waiting or running, by id or path."""
        if isinstance(key, int):
            return self._held.get(key)
        for job in self.backlog:
            if job.named(key):
                return job
        for worker in self.workers:
            for held in worker.held():
                if held is not None and held.named(key):
                    return held
        return None

    def job(self, key: QueueKey) -> Job | None:
        """... or whose ACK just ended it."""
        held = self.holding(key)
        if held is not None:
            return held
        for worker in self.workers:
            for ended in (worker.acking, worker.finished):
                if ended is not None and ended.named(key):
                    return ended
        return None

    def running(self) -> list[tuple[QueueId, float]]:
        """The queries on workers now: queue id, and when each was sent (monotonic)."""
        return [
            (worker.job.queue_id, worker.job.sent_at)
            for worker in self.workers
            if worker.job is not None and worker.job.sent_at is not None
        ]

    def submit(self, job: Job) -> list[Send]:
        self._held[job.queue_id] = job
        self.backlog.append(job)
        return self.assign()

    def _let_go(self, job: Job | None) -> None:
        """`job` is no longer held (ended, acknowledging, removed, its worker gone)."""
        if job is not None and self._held.get(job.queue_id) is job:
            del self._held[job.queue_id]

    def assign(self) -> list[Send]:
        """The backlog's head for each worker that takes one: in the workers' order, or,
        where a process has several lanes, to the least loaded process first."""
        sends: list[Send] = []
        backlog = self.backlog
        if not self._one_lane_each:
            return self._assign_by_load()
        for worker in self.workers:
            if not backlog:
                break
            if worker.takes():
                worker.job = backlog.popleft()
                sends.append((worker, worker.job))
        return sends

    def _assign_by_load(self) -> list[Send]:
        """Each job of the backlog to the least loaded process's free lane, one pass a job
        (a hand-off, a freed lane: usually one)."""
        sends: list[Send] = []
        while self.backlog:
            worker = self._least_loaded()
            if worker is None:
                break
            worker.job = self.backlog.popleft()
            sends.append((worker, worker.job))
        return sends

    def _least_loaded(self) -> Worker | None:
        """A lane that takes a query, of the process running the fewest."""
        best: Worker | None = None
        best_load = 0
        load, free, lanes = 0, None, None
        for lane in self.workers:  # a process's lanes are next to each other
            if lane.lanes is not lanes:
                if free is not None and (best is None or load < best_load):
                    best, best_load = free, load
                load, free, lanes = 0, None, lane.lanes
            if lane.job is not None:
                load += 1
            elif free is None and lane.takes():
                free = lane
        if free is not None and (best is None or load < best_load):
            best = free
        return best

    def unsent(self, worker: Worker, job: Job) -> None:
        """A send that failed (the worker died): first in the backlog again."""
        self.backlog.appendleft(job)
        if worker.job is job:
            worker.job = None

    def acking(self, queue_id: QueueId, task_limit: int | None) -> list[Send]:
        """The ACK of a worker's query is in a batch whose COMMIT starts now: the worker
        runs its next without waiting for that ACK's answer, so it is sent it now. Not a
        worker that may still run a thread of that query (its DRAINING comes once the ACK
        is answered), nor one due to retire after it (`task_limit`)."""
        for worker in self.workers:
            job = worker.job
            if job is None or job.queue_id != queue_id:
                continue
            if (
                worker.next is not None
                or worker.acking is not None
                or worker.draining_since is not None
                or worker.retiring
            ):
                return []
            if job.timed_out or (task_limit and self.executed(worker) + 1 >= task_limit):
                return []
            worker.job, worker.acking = None, job
            self._let_go(job)
            return self.assign()
        return []

    def acked(self, key: QueueKey) -> tuple[Worker, Job | None] | None:
        """An ACK by `key` was answered: the ACK is the last a worker does for a query, so
        the worker whose query it ended is free now (or was made free as the ACK's batch
        committed: `acking`). That worker and the query it starts now (`finish`), or
        None: no worker's query."""
        by_id = isinstance(key, int)
        for worker in self.workers:
            acking, job = worker.acking, worker.job
            if acking is not None and (acking.queue_id == key if by_id else acking.named(key)):
                worker.acking = None
                self.ended(worker, acking)
                return worker, None
            if job is not None and (job.queue_id == key if by_id else job.named(key)):
                return worker, self.finish(worker)
        return None

    def finish(self, worker: Worker) -> Job | None:
        """The worker's query is over: what was sent it meanwhile (`next`) is its job now
        (returned, to be stamped as started)."""
        self._let_go(worker.job)
        self.ended(worker, worker.job)
        worker.job, worker.next = worker.next, None
        return worker.job

    @staticmethod
    def ended(worker: Worker, job: Job | None) -> None:
        if job is not None:
            worker.finished = job
        worker.executed += 1

    def drain(self, worker: Worker, queue_id: QueueId | None, now: float) -> None:
        """A handler thread of the worker's query runs on past its end (cancelled, timed
        out): it takes nothing until the thread ends (`drained`)."""
        worker.draining_since = now
        job = worker.job
        if job is not None and job.queue_id == queue_id:
            self._let_go(job)
            worker.job = None  # its ACK was not answered: it is over all the same
            worker.executed += 1
        elif job is not None:  # sent since its ACK: it waits for the thread, unstarted
            worker.job, worker.next = None, job

    def drained(self, worker: Worker) -> Job | None:
        """The thread ended: what was sent meanwhile starts now (returned)."""
        worker.draining_since = None
        worker.job, worker.next = worker.next, None
        return worker.job

    def removed(self, key: QueueKey) -> list[Send]:
        """The item was cancelled: no longer waiting; a worker holding it is to be told
        (what it runs, its cancel handler runs; one sent ahead is skipped)."""
        for job in [job for job in self.backlog if job.named(key)]:
            self.backlog.remove(job)
            self._let_go(job)
        return [
            (worker, held)
            for worker in self.workers
            for held in worker.held()
            if held is not None and held.named(key)
        ]

    def leave(self, worker: Worker) -> bool:
        """The worker's process exited, every lane of it; False: it had left already."""
        if worker not in self.workers:
            return False
        self.workers = [lane for lane in self.workers if lane.lanes is not worker.lanes]
        for lane in worker.lanes:
            self._let_go(lane.job)
            self._let_go(lane.next)
        return True

    def drop_backlog(self) -> list[Job]:
        """The jobs waiting for a worker, no longer held (to be given back)."""
        dropped = list(self.backlog)
        self.backlog.clear()
        for job in dropped:
            self._let_go(job)
        return dropped

    def clear(self) -> list[Job]:
        """Stopped: everything held unfinished, running first."""
        held = [job for worker in self.workers for job in worker.held() if job is not None]
        held += self.backlog
        self.backlog.clear()
        self.workers.clear()
        self._held.clear()
        return held
