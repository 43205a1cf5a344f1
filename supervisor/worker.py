"""A worker process: it runs the queries its supervisor hands over its pipe, one at a time
or up to its concurrency at once, and reports how each ended; the pool's side of the pipe
is `pool.py`.

A hand-off reaches a worker as JSON over its pipe (`job_message`), never as a pickle: it
is the query as the store holds it. The worker runs it with its own connection to the
supervisor, whose ACK answers it; over the pipe it reports only what the ACK cannot say
(`report`: ended without one, or its outcome lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from typing import Any

import orjson

from queryqueue.driver_socket.protocol import decode_retrieved, encode_retrieved
from queryqueue.engine.queue import QueryQueue
from queryqueue.engine.responses import QueueId
from queryqueue.engine.retrieved import RetrievedQuery
from queryqueue.supervisor import logs, loops
from queryqueue.supervisor.core.linger import Gap
from queryqueue.supervisor.loops import LoopChoice
from queryqueue.supervisor.watch import CANCEL, CANCEL_HANDLER, DRAINING, TIMED_OUT, WorkerWatch

# How long a worker's loop waits on the spot for the outcome of a sync handler that runs
# in a thread, not on the loop's (its cancel handler is async: `Executor.watch`). The
# worker runs one query at a time: meanwhile its loop only heartbeats, reads cancels and
# records what the handler sends, each then that much later. A handler done within it
# costs no wake-up of the loop; a slower one's outcome comes through the loop as before.
SYNC_HANDLER_WAIT = 0.002

# Messages to a worker over its pipe, by their first byte (and _CANCEL); an empty one asks
# it to exit.
JOB = b"J"
# A job retrieved with nothing else pending (the queue is not saturated): after it, the
# worker may poll for its next rather than sleep (`_WorkerLoop`). A saturated queue's
# workers never poll: spinning, they took the CPU its supervisor and callers needed.
JOB_THEN_POLL = b"P"
# From a worker, each followed by the queue id (JSON) of the query it is about (and the
# watch's: DRAINING, a handler of it still runs, no more work till it ends; TIMED_OUT;
# CANCEL_HANDLER). None after an ACK its supervisor answered: the supervisor saw it
# commit, and that ends the query.
DONE = b"done"  # ended without an ACK (cancelled before it started), or drained
LOST = b"lost"  # its outcome could not be stored: give it back


def worker_main(
    app_ref: str,
    socket_path: str,
    conn: Any,
    shm_threshold: int | None,
    event_loop: LoopChoice = "auto",
    poll_s: float = 0.0,
    concurrency: int = 1,
    orphan_grace: float | None = None,
) -> None:
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <worker>` prints where it is
    # Ctrl-C reaches the whole process group: the supervisor stops its workers itself, so
    # a worker neither dies mid-query nor prints a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    supervisor = os.getppid()
    _die_with_parent()
    if orphan_grace is not None:
        import threading

        threading.Thread(
            target=_leave_once_orphaned, args=(supervisor, orphan_grace), daemon=True
        ).start()
    logs.configure(role="worker")  # the supervisor's level and format, on its stream
    loops.run(
        worker_loop(app_ref, socket_path, conn, shm_threshold, supervisor, poll_s, concurrency),
        event_loop,
    )


def job_message(retrieved: RetrievedQuery) -> bytes:
    """What a worker is sent to run `retrieved`: retrieved with nothing else pending (the
    queue is not saturated), it says the worker may poll for its next afterwards."""
    return (JOB if saturates(retrieved) else JOB_THEN_POLL) + encode_retrieved(retrieved)


def saturates(retrieved: RetrievedQuery) -> bool:
    """Retrieved with others left pending: its queue is saturated."""
    return retrieved.queue_size > 0


def report(kind: bytes, queue_id: QueueId) -> bytes:
    return kind + orjson.dumps(queue_id)


def parse_report(message: bytes) -> tuple[bytes | None, QueueId | None, str | None]:
    """A worker's report: its kind, the queue id it is about and, for a TIMED_OUT or a
    CANCEL_HANDLER, its text (None, None, None: unknown)."""
    for kind in (DONE, LOST, DRAINING, TIMED_OUT, CANCEL_HANDLER):
        if not message.startswith(kind):
            continue
        try:
            body = orjson.loads(message[len(kind) :])
        except orjson.JSONDecodeError:
            break
        if kind in (TIMED_OUT, CANCEL_HANDLER):
            match body:
                case [int(queue_id), str(text)]:
                    return kind, queue_id, text
                case _:
                    break
        return kind, body if isinstance(body, int) else None, None
    return None, None, None


async def _run_to_its_ack(queue: QueryQueue, retrieved: RetrievedQuery) -> asyncio.Future[bool]:
    """Run `retrieved` until its ACK goes out; the future of `execute_query` (True once
    the ACK is answered) is returned then, running on."""
    sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def acknowledging(*_: object) -> None:
        if not sent.done():
            sent.set_result(None)

    running = asyncio.ensure_future(
        queue.executor.execute_query(retrieved, acknowledging=acknowledging)
    )
    running.add_done_callback(acknowledging)  # it ended before an ACK (never raises)
    await sent
    return running


def _reported(
    conn: Any, queue_id: QueueId, acks: set[asyncio.Future[bool]], running: asyncio.Future[bool]
) -> None:
    """A query the worker went on from: its ACK answered, or lost (the supervisor gives
    it back)."""
    acks.discard(running)
    if not running.cancelled() and not running.result():
        with contextlib.suppress(OSError, ValueError):
            conn.send_bytes(report(LOST, queue_id))


def _leave_once_orphaned(supervisor: int, grace: float) -> None:
    """On a thread of its own (a sync handler may hold the loop's): once the supervisor
    is gone, other hosts reap what this worker runs when the supervisor's lease runs out.
    It leaves `grace` (half the lease) after, its queries and their threads with it: never
    two executions of one query at once (`processes._orphan_grace`)."""
    import logging

    while os.getppid() == supervisor:
        time.sleep(0.1)
    time.sleep(grace)
    logging.getLogger("queryqueue.worker").warning(
        "the supervisor is gone, and what this worker ran is another host's to run: leaving"
    )
    os._exit(1)


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG: the kernel sends SIGTERM when the supervisor dies, whatever
    happens to the pipe (Linux only; elsewhere the pipe's EOF alone tells)."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


class _WorkerLoop:
    """Run what the supervisor hands over, one query at a time (`concurrency` 1) or up to
    `concurrency` at once (`_serve_many`).

    One at a time, the next starts once the
    last one's ACK has gone out, not once it is answered (the supervisor sends the next as
    that ACK's batch commits, `WorkerPool.acking`); a query whose ACK is then not stored
    through every retry is reported lost, later.

    When the supervisor dies (the pipe's EOF, or SIGTERM from PR_SET_PDEATHSIG) the worker
    takes no more work and finishes the query in hand: its ACK goes to a supervisor that is
    back on the socket within the client's reconnect timeout (no work lost), else the item
    is reclaimed as stalled by the next one. Then it exits.

    Between queries it polls for the next rather than sleep when that usually comes within
    `poll_s` of its last ACK (linger.Gap): a caller sending queries one after another has
    the next handed over a few hundred microseconds later, and on a VM the wake-up of a
    halted vCPU costs tens of them."""

    def __init__(self, queue: QueryQueue, conn: Any, poll_s: float, concurrency: int = 1) -> None:
        self.queue, self.conn, self.poll_s = queue, conn, poll_s
        self.concurrency = concurrency
        self.loop = asyncio.get_running_loop()
        self.arrived: asyncio.Queue[bytes] = asyncio.Queue()
        self.unstarted_cancels: set[int] = set()
        self.acks: set[asyncio.Future[bool]] = set()  # queries over but for their ACK's answer
        # One at a time, a sync handler runs on this loop's thread, watched from another.
        self.watch = WorkerWatch(conn, self.heard, self.loop) if concurrency == 1 else None
        queue.executor.watch = self.watch
        if concurrency == 1:
            queue.executor.sync_handler_wait = SYNC_HANDLER_WAIT

    def gone(self) -> None:
        # Read once: an fd at EOF stays readable, and a reader left on it spins the loop.
        with contextlib.suppress(ValueError, OSError):
            self.loop.remove_reader(self.conn.fileno())
        self.arrived.put_nowait(b"")

    def readable(self) -> None:
        try:
            message = self.conn.recv_bytes()
        except (EOFError, OSError):
            self.gone()
            return
        self.heard(message)

    def heard(self, message: bytes) -> None:
        if message.startswith(CANCEL):
            queue_id = orjson.loads(message[1:])
            if not self.queue.cancel_execution(queue_id):
                self.unstarted_cancels.add(queue_id)  # sent ahead and cancelled: never start it
        else:
            self.arrived.put_nowait(message)

    async def run(self, supervisor: int) -> None:
        import signal

        self.loop.add_reader(self.conn.fileno(), self.readable)
        self.loop.add_signal_handler(signal.SIGTERM, self.gone)
        if os.getppid() != supervisor:  # it died before PR_SET_PDEATHSIG was in place
            self.gone()
        try:
            await self._serve()
        finally:
            with contextlib.suppress(ValueError, OSError):
                self.loop.remove_reader(self.conn.fileno())
            self.loop.remove_signal_handler(signal.SIGTERM)
            if self.watch is not None:
                self.watch.close()
            if self.acks:  # their answers (or their retries' end) before the connection closes
                await asyncio.gather(*self.acks, return_exceptions=True)

    async def _serve(self) -> None:
        if self.concurrency > 1:
            await self._serve_many()
            return
        next_query, may_poll, polling = Gap(), False, loops.Polling(self.loop)
        while True:
            waited_from = time.monotonic()
            if may_poll and self.arrived.empty():
                until = next_query.poll_until(waited_from, self.poll_s)
                if until is not None:
                    polling.extend(until)
            blob = await self.arrived.get()
            polling.stop()
            if self.poll_s > 0:
                next_query.heard(time.monotonic() - waited_from, self.poll_s)
            may_poll = self.poll_s > 0 and blob[:1] == JOB_THEN_POLL
            if not blob:
                return
            await self._run_one(decode_retrieved(blob[1:]))

    async def _serve_many(self) -> None:
        """Each query on a task of its own, up to `concurrency` at once: async handlers on
        this loop, sync ones on handler threads. The pool sends no more than that; a query
        waits here only for room a stopped sync handler still takes (`_run_in_room`)."""
        room = asyncio.Semaphore(self.concurrency)
        running: set[asyncio.Task[None]] = set()
        while blob := await self.arrived.get():
            task = asyncio.ensure_future(self._run_in_room(room, decode_retrieved(blob[1:])))
            running.add(task)
            task.add_done_callback(running.discard)
        if running:  # the pipe ended: what was sent runs to its end first
            await asyncio.gather(*running, return_exceptions=True)

    async def _run_in_room(self, room: asyncio.Semaphore, retrieved: RetrievedQuery) -> None:
        """Run `retrieved` while it holds a place in `room`: from its start until its ACK
        goes out (the pool sends the next as that ACK commits), or, for a sync handler
        cancelled or timed out, until its thread ends (Python cannot stop it, and it still
        works the data source)."""
        queue, queue_id = self.queue, retrieved.queue_id
        async with room:
            if queue_id in self.unstarted_cancels:
                self.unstarted_cancels.discard(queue_id)
                with contextlib.suppress(OSError, ValueError):
                    self.conn.send_bytes(report(DONE, queue_id))
                return
            running = await _run_to_its_ack(queue, retrieved)
            if queue.executor.handler_thread_runs(queue_id):
                await asyncio.to_thread(queue.executor.wait_for_handler_threads, None, queue_id)
        if not await running:
            with contextlib.suppress(OSError, ValueError):
                self.conn.send_bytes(report(LOST, queue_id))  # the supervisor gives it back

    async def _run_one(self, retrieved: RetrievedQuery) -> None:
        queue, conn, queue_id = self.queue, self.conn, retrieved.queue_id
        if queue_id in self.unstarted_cancels:
            self.unstarted_cancels.discard(queue_id)
            conn.send_bytes(report(DONE, queue_id))
            return
        running = await _run_to_its_ack(queue, retrieved)
        if self.watch is not None and self.watch.stopped(queue_id):
            # Cancelled or timed out while it ran on this thread: the watch told the
            # pool it is over (so its next waits) and now it has ended.
            reported = await running
            with contextlib.suppress(OSError, ValueError):
                conn.send_bytes(report(DONE if reported else LOST, queue_id))
            return
        if not running.done() and not queue.handler_threads:
            self.acks.add(running)
            running.add_done_callback(functools.partial(_reported, conn, queue_id, self.acks))
            return
        # True: its ACK was answered, which told the supervisor this query is over.
        reported = await running
        with contextlib.suppress(OSError, ValueError):
            if queue.handler_threads:
                # A cancelled or timed-out sync handler is still running: take no more
                # work; the pool terminates this process unless the thread ends within
                # the grace.
                conn.send_bytes(report(DRAINING, queue_id))
                await asyncio.to_thread(queue.wait_for_handler_threads)
                conn.send_bytes(report(DONE if reported else LOST, queue_id))
            elif not reported:
                conn.send_bytes(report(LOST, queue_id))  # the supervisor gives it back


async def worker_loop(
    app_ref: str,
    socket_path: str,
    conn: Any,
    shm_threshold: int | None,
    supervisor: int,
    poll_s: float = 0.0,
    concurrency: int = 1,
) -> None:
    """A worker's life on its loop (`_WorkerLoop`): the app loaded and its worker start
    hooks run, a connection to the supervisor, queries run until the pipe ends, then its
    stop hooks and everything closed."""
    from queryqueue.app import load_app
    from queryqueue.driver_socket.client import SocketQueueDriver

    app = load_app(app_ref)
    await app.hooks.started()
    driver = SocketQueueDriver(socket_path, shm_threshold=shm_threshold)
    queue = app.pool_queue(driver)
    try:
        await _WorkerLoop(queue, conn, poll_s, concurrency).run(supervisor)
    finally:
        await queue.close(grace=0)
        await driver.close()
        await app.hooks.stopped()
