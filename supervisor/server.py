"""The supervisor's queue server: one process owns the store and serves every other process.

Like Cube Store, it serializes every write. Commands from all connections go through one
runner that runs whatever has arrived together in one transaction (group commit: one
WAL commit), each command in a savepoint of its own, and answers only once that
transaction has committed (with SQLite FULL, once a sync covers it: synced.py).
RESULT_BLOCKING is parked in memory and woken by the ACK that completes the item (or
answered empty at its timeout): nothing polls.

This module is the shell that wires the parts: connections (connection.py) feed the
inbox (core/inbox.py); a runner chosen once for the store (loop_runner.py, lane_runner.py)
runs each batch as one transaction (core/transaction.py), whose hand-offs go to the pool
one way (core/handoff.py), and whose answers go out through answering.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

import orjson

from queryqueue.driver_socket.deadlines import Deadlines
from queryqueue.driver_socket.frames import FrameReader
from queryqueue.driver_socket.protocol import error_payload
from queryqueue.driver_socket.segments import name_prefix
from queryqueue.engine.errors import InvalidCommandError, QueueError, StoreError
from queryqueue.engine.listing import PURGE_BATCH
from queryqueue.engine.responses import QueueId
from queryqueue.engine.store import QueueStore
from queryqueue.supervisor import guard, loops
from queryqueue.supervisor.answering import Answers
from queryqueue.supervisor.connection import Connection, FrameClient, Limits
from queryqueue.supervisor.core.handoff import HandOff
from queryqueue.supervisor.core.inbox import Inbox
from queryqueue.supervisor.core.requests import (
    Request,
    Shapes,
    follow_up,
    make_request,
    read_message,
)
from queryqueue.supervisor.core.slots import Job
from queryqueue.supervisor.core.transaction import BatchTransaction
from queryqueue.supervisor.lane_runner import LaneRunner
from queryqueue.supervisor.lease import LeaseKeeper
from queryqueue.supervisor.loop_runner import LoopRunner
from queryqueue.supervisor.own_commands import OwnCommands
from queryqueue.supervisor.polls import ParkedPoll, parked_deadlines
from queryqueue.supervisor.pool import WorkerPool, pools_described
from queryqueue.supervisor.runner import Runner
from queryqueue.supervisor.settings import Settings
from queryqueue.supervisor.shm import SegmentPool
from queryqueue.supervisor.stats import Stats
from queryqueue.supervisor.synced import SyncGate

__all__ = ["Limits", "QueueServer", "Settings"]

_log = logging.getLogger("queryqueue.server")

# How long a stopping supervisor lets its clients take their last answers.
_HANG_UP_S = 10.0


def _check_tcp(host: str | None, token: str | None) -> None:
    if host is not None and host not in ("127.0.0.1", "::1", "localhost"):
        raise ValueError(f"the TCP listener is for loopback only, not {host!r}")
    if host is not None and not token:
        # Any local user can reach a loopback port: without a secret, they could read
        # every payload and result.
        raise ValueError("the TCP listener needs an auth token (--auth-token-file)")


class QueueServer:
    def __init__(
        self,
        store: QueueStore,
        socket_path: str | Path,
        *,
        tcp_host: str | None = None,
        tcp_port: int | None = None,
        pool: WorkerPool | None = None,
        pools: Sequence[WorkerPool] = (),
        segments: SegmentPool | None = None,
        tcp_token: str | None = None,
        limits: Limits | None = None,
        settings: Settings | None = None,
    ) -> None:
        _check_tcp(tcp_host, tcp_token)
        self.tcp_token = tcp_token
        self.tcp_host, self.tcp_port = tcp_host, tcp_port
        self.limits = limits or Limits()
        self.settings = settings or Settings()
        self.store = store
        self.socket_path = Path(socket_path)
        self.stats = Stats()
        # Set by `--http` (metrics.py): fed from the answers; None costs nothing.
        self.metrics: Any | None = None
        # One pool a queue it serves (`pool`: one alone; `pools`: several).
        self.pools = [*([pool] if pool is not None else []), *pools]
        self.pool = self.pools[0] if self.pools else None
        for each in self.pools:
            each.noted = self.note
        self.segments = segments or SegmentPool(
            name_prefix(socket_path), result_ttl=store.result_ttl_ms / 1000
        )
        self.connections: set[Connection] = set()
        # The server's own commands (its workers' notes) come from here; answered to
        # nobody (closed), and not in the clients' command stats.
        self.own: Connection | None = None
        self.stopping = False
        self.gate: SyncGate | None = None  # set by start, for a store syncing in the background
        self.deadlines: Deadlines[ParkedPoll] | None = None  # parked polls' (start)
        self.inbox = Inbox(self.settings.max_batch)
        self.shapes = Shapes(store)
        self.hand_off = HandOff(self.pools)
        self.transaction = BatchTransaction(store, self.hand_off, self._to_loop)
        self.answers = Answers(self)
        self.own_commands = OwnCommands(self)
        self.runner: Runner = LaneRunner(self) if store.blocking else LoopRunner(self)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._merged: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}  # `_of_pools`
        self._servers: list[asyncio.Server] = []
        self._handlers: set[asyncio.Task[None]] = set()
        self._sweeper: asyncio.Future[Any] | None = None
        self.lease = LeaseKeeper(store, self.pools)
        self._socket_lock: guard.Lock | None = None
        self._stop_watching: Any = None
        self._socket_identity: tuple[int, int] | None = None
        # Set when the store failed for good (a WAL sync): the server has hung up on every
        # client and accepts no more; its process stops (process.py).
        self.failed = asyncio.Event()
        self.failure: BaseException | None = None

    async def start(self) -> None:
        guard.private_directory(self.socket_path.parent)
        self._socket_lock = guard.Lock(
            guard.lock_path(self.socket_path), f"socket {self.socket_path}"
        )
        try:
            guard.clear_stale_socket(self.socket_path)  # a dead supervisor's, nobody else's
            await self._listen()
        except BaseException:
            self._socket_lock.release()
            raise
        self._stop_watching = self.store.watch_slots(self.answers.nudge_soon)
        # A blocking store runs a batch's long polls' first look on its lane: their waiters
        # belong to this loop.
        self.store.waiters.home = asyncio.get_running_loop()
        self.deadlines = parked_deadlines(self.store.waiters.home)
        # Coming back after a crash: executors that lived through the outage could not
        # heartbeat, so give them a full timeout to reconnect before anything is reaped.
        self.store.refresh_active_heartbeats()
        self.store.beat_host()
        self.segments.adopt()  # large results a crashed supervisor acknowledged
        self._loop = asyncio.get_running_loop()
        if self.store.background_sync:
            self.gate = SyncGate(
                self.store, self._loop, self._store_failed, expecting=self._pool_runs
            )
        self.runner.start(self._loop)
        self._sweeper = asyncio.gather(self._sweep_forever(), self.lease.keep())

    def _pool_runs(self) -> bool:
        """Whether the pool holds a query, whose ACK will commit soon (synced.py)."""
        return any(pool.held > 0 for pool in self.pools)

    async def _listen(self) -> None:
        loop = asyncio.get_running_loop()
        old_umask = os.umask(0o177)  # the socket is born 0600: no window with wider access
        try:
            self._servers.append(
                await loop.create_unix_server(
                    lambda: self._reader(authenticated=True), path=str(self.socket_path)
                )
            )
        finally:
            os.umask(old_umask)
        self._socket_identity = guard.socket_identity(self.socket_path)
        if self.tcp_host is not None:
            self._servers.append(
                await loop.create_server(
                    lambda: self._reader(authenticated=False), self.tcp_host, self.tcp_port or 0
                )
            )

    async def _sweep_forever(self) -> None:
        purged_at = time.monotonic()
        while True:
            await asyncio.sleep(min(0.5, self.settings.purge_interval))
            self.segments.sweep()
            for pool in self.pools:
                # Batches retrieve for the pools themselves; their reconciles (stalled and
                # orphaned items, anything a batch could not take) still run this often.
                pool.poke()
            if time.monotonic() - purged_at >= self.settings.purge_interval:
                purged_at = time.monotonic()
                # ACKs purge as they go; this keeps an idle queue from holding its dead.
                try:
                    await self._purge_expired()
                except QueueError as exc:
                    _log.warning("purging expired results failed: %s", exc)

    async def _purge_expired(self) -> None:
        """Expired results, a bounded batch a transaction, batch after batch while each
        comes back full: the results of a busy hour that expire together go in one sweep,
        not a batch every `purge_interval` (64 every 10 s kept 20,000 for most of an hour).
        The loop turns between batches, so commands are served meanwhile."""
        purged = 0
        while not self.stopping:
            gone = await self.store.run_off_loop(self.store.purge_expired)
            purged += gone
            if gone < PURGE_BATCH:
                break
            await asyncio.sleep(0)
        self.stats.swept(purged)

    @property
    def tcp_address(self) -> tuple[str, int] | None:
        for server in self._servers[1:]:
            host, port = server.sockets[0].getsockname()[:2]
            return str(host), int(port)
        return None

    async def stop(self) -> None:
        """Stop accepting, answer parked long-polls with their timeout answer, finish what
        has arrived, then checkpoint the WAL."""
        self.stopping = self.transaction.stopping = True
        for server in self._servers:
            server.close()
        self.runner.stop()
        for connection in list(self.connections):
            for task in list(connection.parked):
                task.cancel()
        await asyncio.sleep(0)
        self.runner.run_rest()
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        await self.runner.finish()
        if self.gate is not None:
            for connection in list(self.connections):
                self.gate.release_now(connection)  # one sync, for all of them
        readers = [connection.reader for connection in self.connections]
        for reader in readers:
            reader.close()  # after what it was answered has been written
        if readers:
            await asyncio.wait([reader.closed for reader in readers], timeout=_HANG_UP_S)
        for reader in readers:
            if reader.transport is not None and not reader.closed.done():
                reader.transport.abort()  # a client that reads nothing of it
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        with contextlib.suppress(StoreError):
            self.store.checkpoint()
        self.segments.close()
        if self.deadlines is not None:
            self.deadlines.close()
        if self._stop_watching is not None:
            self._stop_watching()
        guard.unlink_if_ours(self.socket_path, self._socket_identity)
        if self._socket_lock is not None:
            self._socket_lock.release()

    def _store_failed(self, error: BaseException) -> None:
        if self.failure is not None:
            return
        self.failure = error
        _log.critical(
            "the queue store cannot make its commits durable (%s): hanging up on every "
            "client, stopping",
            error,
        )
        for server in self._servers:
            server.close()
        for connection in list(self.connections):
            connection.cut_off()
        self.failed.set()

    # -- connections (connection.Served) ----------------------------------------------------

    def loop(self) -> asyncio.AbstractEventLoop:
        # Kept since start: on 3.11 each get_running_loop() is a getpid() system call.
        return self._loop or asyncio.get_running_loop()

    def running(self) -> list[tuple[QueueId, float]]:
        """The queries the pools' workers run now: queue id, when each was sent."""
        if len(self.pools) == 1:
            return self.pools[0].running()
        return [running for pool in self.pools for running in pool.running()]

    def job(self, key: Any) -> Job | None:
        """A pool's job of an item (waiting, running, or whose ACK just ended it)."""
        for pool in self.pools:
            job = pool.job(key)
            if job is not None:
                return job
        return None

    def _of_pools(self, name: str) -> Any:
        """The pools' `budgets` or `served` (prefix -> ...); None until every pool has
        started (and with no pool). Merged once per change, not per request."""
        if len(self.pools) == 1:
            return getattr(self.pools[0], name)
        parts = [getattr(pool, name) for pool in self.pools]
        if not parts or any(part is None for part in parts):
            return None
        cached = self._merged.get(name)
        # Held, so compared by identity: a pool's mapping is replaced, never changed.
        if cached is None or any(a is not b for a, b in zip(cached[0], parts, strict=True)):
            merged = {k: v for part in parts for k, v in part.items()}
            cached = self._merged[name] = (tuple(parts), merged)
        return cached[1]

    def _to_loop(self, callback: Any) -> None:
        """A callback from a lane's thread, run on the loop."""
        self.loop().call_soon_threadsafe(callback)

    def soon(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` on the loop, cancelled at the stop."""
        task = asyncio.ensure_future(work)
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)

    def flush_soon(self, connection: Connection) -> None:
        self.answers.flush_soon(connection)

    def opened(self, connection: Connection) -> None:
        self.connections.add(connection)

    def accept(self, connection: Connection, body: bytes) -> None:
        self.runner.heard(connection)
        request_id: Any = None
        try:
            message = orjson.loads(body)
            if not isinstance(message, dict):
                raise InvalidCommandError("a request must be a JSON object")
            request_id = message.get("id")
            if not connection.authenticated:
                self.own_commands.authenticate(connection, message, request_id)
                return
            received = time.monotonic()
            read = read_message(message)
            if not read.queued:
                self.own_commands.serve(connection, request_id, read.method, read.args, read.kwargs)
                return
            request = make_request(
                connection, request_id, read, received,
                shapes=self.shapes,
                process_id=connection.process_id,
                budgets=self._of_pools("budgets"),
                served=self._of_pools("served"),
            )  # fmt: skip
        except orjson.JSONDecodeError as exc:
            error = InvalidCommandError(f"frame is not JSON: {exc}")
            connection.send({"id": None, "error": error_payload(error)})
            return
        except QueueError as exc:
            connection.send({"id": request_id, "error": error_payload(exc)})
            return
        self.enqueue(request)
        if request.then_wait is not None:
            # In the same batch as its ADD, or the next: it reads the id the ADD answered.
            self.enqueue(follow_up(request))

    def enqueue(self, request: Request) -> None:
        connection = request.connection
        if request.method == "result_blocking":
            polls = len(connection.parked) + connection.polls_queued
            if polls >= connection.limits.max_parked:
                error = InvalidCommandError(
                    f"result_blocking: this connection has {polls} long "
                    f"polls waiting, the limit is {connection.limits.max_parked}"
                )
                connection.send({"id": request.id, "error": error_payload(error)})
                return
            if self.runner.polls_itself(request):
                return
            # Its first look runs in the batch (a savepoint of the batch's transaction, not
            # a transaction of its own); not found, it parks as the batch is answered.
            connection.polls_queued += 1
        connection.in_flight += 1
        self.inbox.append(request)
        self.runner.arrived(request)
        self.runner.schedule()

    def _reader(self, *, authenticated: bool) -> FrameReader:
        return FrameReader(
            FrameClient(self, authenticated),
            self.settings.max_frame,
            high_water=self.limits.high_water,
        )

    def held_back(self, connection: Connection) -> bool:
        """Read no more from a client while its unsent answers pass the high-water mark,
        too many of its requests wait for theirs, or a batch's worth (its runner's) waits
        in the inbox: a flood from one client is read as the batches take it, and the rest
        (a worker's ACK) is read meanwhile, not after the whole flood was parsed."""
        limits = connection.limits
        held = not connection.closed and (
            connection.in_flight >= limits.max_in_flight
            or connection.reader.writing_paused
            or connection.buffered() > limits.high_water
            or self.inbox.queued_from(connection)
            >= (self.runner.batch_limit() or self.inbox.max_batch)
        )
        if held and not connection.throttled:
            self.stats.throttled += 1
        connection.throttled = held
        return held

    def lost(self, connection: Connection) -> None:
        connection.closed = True
        if self.gate is not None:
            self.gate.forget(connection)
        for parked in list(connection.parked):
            parked.cancel()
        self.connections.discard(connection)
        self.segments.drop_owner(connection)

    async def describe(self) -> dict[str, Any]:
        pool = pools_described([pool.describe() for pool in self.pools]) if self.pools else {}
        wal = self.store.wal_state()
        return {
            **pool,
            **self.stats.snapshot(),
            **(await self.store.run_off_loop(self.store.describe)),
            **self.lease.describe(),
            "shared_memory": self.segments.describe(),
            "connections": len(self.connections),
            "long_polls": sum(len(c.parked) for c in self.connections),
            "pid": os.getpid(),
            "event_loop": loops.running_name(),
            "collector": loops.collector_state(),
            "files": self.store.files(),
            **({"wal": {**wal, **self._held_for_sync()}} if wal is not None else {}),
        }

    def _held_for_sync(self) -> dict[str, int]:
        return {"answers_held_for_sync": self.gate.held} if self.gate is not None else {}

    def note(self, queue_id: QueueId, extra: str) -> None:
        """A worker's note (the cancel handler its query set, carried by its watch): a
        MERGE_EXTRA of the server's own, in the next batch with whatever else came, on
        every store (a refused one is answered to nobody)."""
        if self.own is None:
            self.own = Connection(self._reader(authenticated=True), lambda _: None, closed=True)
        request = Request(
            self.own, None, "merge_extra", [queue_id, extra], {}, None, time.monotonic()
        )
        self.enqueue(request)
