"""The supervisor's queue server: one process owns the store and serves every other process.

Like Cube Store, it serializes every write. Commands from all connections go through one
executor that runs whatever has arrived together in one transaction (group commit: one
WAL commit), each command in a savepoint of its own, and answers only once that
transaction has committed (with SQLite FULL, once a sync covers it: synced.py).
RESULT_BLOCKING is parked in memory and woken by the ACK that completes the item (or
answered empty at its timeout): nothing polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import inspect
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson

from queryqueue.driver_socket.deadlines import Deadlines
from queryqueue.driver_socket.frames import FrameReader
from queryqueue.driver_socket.protocol import (
    DEFAULT_MAX_FRAME,
    FrameError,
    answer_frame,
    encode_body,
    encode_frame,
    error_payload,
)
from queryqueue.driver_socket.segments import name_prefix, parse_reference
from queryqueue.engine.commands import Command, served
from queryqueue.engine.connection import decode_def, decode_query
from queryqueue.engine.errors import (
    AuthenticationError,
    InvalidCommandError,
    QueueError,
    StoreError,
)
from queryqueue.engine.lanes import route_of
from queryqueue.engine.responses import AddAndRetrieveResponse, QueueId
from queryqueue.engine.retrieved import RetrievedQuery
from queryqueue.engine.store import QueueStore
from queryqueue.engine.validation import check_key, check_prefix, check_priority, check_process_id
from queryqueue.engine.waiters import AckEvent, Waiter
from queryqueue.supervisor import cube_results, guard, loops, sqltext
from queryqueue.supervisor.linger import POLL_S, Gap, Linger
from queryqueue.supervisor.polls import ParkedPoll, parked_deadlines
from queryqueue.supervisor.pool import WorkerPool
from queryqueue.supervisor.shm import SegmentPool
from queryqueue.supervisor.stats import Stats
from queryqueue.supervisor.synced import SyncGate

_log = logging.getLogger("queryqueue.server")

# The QUEUE commands a client may call, as the store declares them.
COMMANDS = served()

# How many argument shapes found fine a command keeps (`_Shape.fine`).
_SHAPES_KEPT = 64
# How long a stopping supervisor lets its clients take their last answers.
_HANG_UP_S = 10.0
# The commands whose answer tells their prefix's pending count once they ran.
_REPORT_PENDING = frozenset({"add", "add_and_retrieve", "retrieve"})
# The commands whose concurrency is the pool's budget for its own queue (`_budget`).
_BUDGETED = frozenset({"add_and_retrieve", "retrieve"})
# What a pool's worker says of the query it runs, besides its ACK (`_note_acks`).
_POOL_STEPS = frozenset({"heartbeat", "merge_extra"})
# How long an ADD may wait for the batch of the ACK that frees its slot (_may_hold).
HOLD_ADDS_S = 0.002
# An ADD's answer waits at most this long for its pipelined long poll's (`defer`).
DEFER_ADD_ANSWER_S = 0.005


@dataclass(frozen=True)
class Limits:
    """What one connection may cost the supervisor, whatever its client does."""

    # Unsent answer bytes past which the connection is not read until its client catches
    # up (a client that does not read its answers slows only itself).
    high_water: int = 8 * 1024 * 1024
    # Unsent answer bytes past which the connection is closed (above the frame limit, so
    # one large answer alone never trips it).
    hard_limit: int = 512 * 1024 * 1024
    max_in_flight: int = 4096  # requests read and not yet answered
    max_parked: int = 1024  # RESULT_BLOCKING long polls waiting at once
    # A SQL-text RESULT of a result a Cube client cannot follow (shared memory, binary)
    # is materialised as JSON up to this many bytes, else refused naming this limit.
    max_sql_result: int = cube_results.DEFAULT_SQL_RESULT_LIMIT


@dataclass(eq=False)
class _Connection:
    reader: FrameReader
    # Queues a connection with answers to write for its loop iteration's one write pass
    # (`QueueServer._flush_soon`).
    flush_soon: Callable[[_Connection], None]
    limits: Limits = field(default_factory=Limits)
    # Unix-socket peers passed the socket's permissions; a TCP peer must send the token.
    authenticated: bool = True
    hang_up: bool = False  # refused: answered, then closed
    process_id: str | None = None
    parked: set[asyncio.Task[None] | ParkedPoll] = field(default_factory=set)
    closed: bool = False
    # Answers of one loop iteration (a batch) leave in one write: a syscall per answer
    # was a fifth of the supervisor's time.
    outbox: list[bytes] = field(default_factory=list)
    # Prefixes whose freed slots this connection wants to hear of (a process waiting to
    # retrieve its own stream item: nobody else may retrieve it for it).
    watching: set[str] = field(default_factory=set)
    in_flight: int = 0
    polls_queued: int = 0  # long polls in the inbox, not yet parked (counted to the limit)
    # Made on the loop. Kept: on 3.11 each get_running_loop() is a getpid() syscall.
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    throttled: bool = False  # not read until its client catches up
    # ADD answers held for their long poll's (`defer`), by id() of the ADD's request.
    deferred: dict[int, bytes] = field(default_factory=dict)
    deferred_timer: asyncio.TimerHandle | None = None
    # A store that syncs in the background: frames wait for their commit (synced.py).
    gate: SyncGate | None = None
    unsynced: deque[tuple[int, bytes]] = field(default_factory=deque)
    # A pool worker's (its ACKs are pool steps): written after the callers' in a pass.
    worker: bool = False

    @property
    def transport(self) -> asyncio.Transport:
        assert self.reader.transport is not None  # set before a connection is made
        return self.reader.transport

    def gone(self) -> bool:
        return self.closed or self.transport.is_closing()

    def buffered(self) -> int:
        held = sum(len(frame) for _, frame in self.unsynced) if self.unsynced else 0
        return self.transport.get_write_buffer_size() + sum(map(len, self.outbox)) + held

    def send(self, message: dict[str, Any], *, after_sync: bool = True) -> None:
        """`after_sync`: held until what has committed so far is durable (synced.py)."""
        if self.gone():
            return
        self._queue(_frame_of(message), after_sync=after_sync)

    def send_answer(self, request_id: Any, encoded: bytes) -> None:
        """`{"id": request_id, "ok": <encoded>}`, its answer already JSON."""
        if self.gone():
            return
        self._queue(answer_frame(request_id, encoded))

    def _queue(self, frame: bytes, *, after_sync: bool = True) -> None:
        gate = self.gate
        if gate is not None and after_sync:
            commit = gate.commit_to_wait_for()
            if commit is not None or self.unsynced:
                if self.unsynced:  # in order: not before what is held already
                    commit = max(commit or 0, self.unsynced[-1][0])
                assert commit is not None
                self.unsynced.append((commit, frame))
                gate.hold(self, commit)
                return
        if not self.outbox:
            self.flush_soon(self)
        self.outbox.append(frame)

    def release_synced(self, commit: int | None) -> None:
        unsynced = self.unsynced
        while unsynced and (commit is None or unsynced[0][0] <= commit):
            self._queue(unsynced.popleft()[1], after_sync=False)

    def cut_off(self) -> None:
        self.unsynced.clear()
        if not self.gone():
            self.closed = True
            self.transport.abort()

    def defer(self, add: _Request, message: dict[str, Any], delay: float) -> None:
        """The answer of an ADD whose pipelined long poll has parked: its caller waits for
        the result, not for this. It leaves with that poll's answer (one wake-up of the
        caller, not two), or at most `delay` later, whichever comes first."""
        if self.gone():
            return
        self.deferred[id(add)] = _frame_of(message)
        if self.deferred_timer is None:
            self.deferred_timer = self.loop.call_later(delay, self.release_deferred)

    def release_deferred(self, add: _Request | None = None) -> None:
        """Send the deferred answer of `add` (None: all of them) ahead of what follows."""
        if add is None:
            frames, self.deferred = list(self.deferred.values()), {}
        else:
            frame = self.deferred.pop(id(add), None)
            frames = [] if frame is None else [frame]
        for frame in frames:
            self._queue(frame)
        if not self.deferred and self.deferred_timer is not None:
            self.deferred_timer.cancel()
            self.deferred_timer = None

    def flush(self) -> None:
        frames, self.outbox = self.outbox, []
        if frames and not self.gone():
            transport = self.transport
            transport.write(b"".join(frames))
            if transport.get_write_buffer_size() > self.limits.hard_limit:
                # Its client reads nothing of what it asked for: cut it off, and free it all.
                self.closed = True
                transport.abort()
                return
        if self.throttled:
            self.reader.resume()


class _Client:
    """A connection's frames, to the server (frames.FrameSink)."""

    def __init__(self, server: QueueServer, authenticated: bool) -> None:
        self.server = server
        self.authenticated = authenticated
        self.connection: _Connection | None = None

    def opened(self, reader: FrameReader) -> None:
        server = self.server
        self.connection = _Connection(
            reader,
            server._flush_soon,
            server.limits,
            authenticated=self.authenticated,
            gate=server._gate,
        )
        server._connections.add(self.connection)

    def received(self, body: bytes) -> None:
        connection = self.connection
        assert connection is not None
        if self.server._stopping or connection.closed:
            connection.reader.close()
            return
        self.server._accept(connection, body)
        if connection.hang_up:
            connection.reader.close()

    def held_back(self) -> bool:
        assert self.connection is not None
        return self.server._held_back(self.connection)

    def refused(self, error: FrameError) -> None:
        # The stream cannot be resynchronized: say why, then hang up on this client.
        assert self.connection is not None
        self.connection.send({"id": None, "error": error_payload(error)})

    def ending(self) -> None:
        assert self.connection is not None
        connection = self.connection
        connection.release_deferred()
        if connection.gate is not None:
            connection.gate.release_now(connection)
        connection.flush()  # what was answered before the hang-up still leaves

    def lost(self) -> None:
        if self.connection is not None:
            self.server._lost(self.connection)


def _acks_first(batch: list[_Request]) -> list[_Request]:
    """A batch on the loop with the commands of connections that sent an ACK (its workers)
    before all the others, each connection's in the order they came: the slots the ACKs
    free are filled, and their workers sent their next, before the rest runs
    (`_hand_off_early`). As in `_acks_last`, commands of different connections that
    arrived together have no order between them to keep."""
    acking, others = _acking_apart(batch)
    if not (acking and others) or all(a is b for a, b in zip(acking, batch, strict=False)):
        return batch
    return acking + others


def _acking_end(batch: list[_Request]) -> int:
    """Where the leading commands of a batch's ACKing connections end (`_acks_first`):
    -1 when none lead, or nothing follows them."""
    acking = {id(r.connection) for r in batch if r.method == "ack"}
    if not acking:
        return -1
    for i, request in enumerate(batch):
        if id(request.connection) not in acking:
            return i if i else -1
    return -1


def _acked_ids(batch: list[_Request], answers: list[tuple[bool, Any]]) -> list[QueueId]:
    """The queue ids of a batch's answered ACKs (read on a lane too: nothing of the
    pool's, which is the loop's)."""
    return [
        request.args[0]
        for request, (ok, _) in zip(batch, answers, strict=True)
        if ok and request.method == "ack" and type(request.args[0]) is int
    ]


def _frame_of(message: dict[str, Any]) -> bytes:
    try:
        return encode_frame(message)
    except TypeError as exc:
        return encode_frame({"id": message.get("id"), "error": error_payload(exc)})


@dataclass(frozen=True)
class _Shape:
    """The arguments a store method takes: checked per request without Signature.bind,
    which cost 3% of the supervisor's time."""

    names: tuple[str, ...]  # positional-or-keyword, in order
    required: frozenset[str]
    keywords: frozenset[str]
    # Argument counts and keyword names (in the order sent) found fine: a client sends
    # the same few shapes again and again. Bounded: a client cannot grow it for long.
    fine: set[tuple[int, tuple[str, ...]]] = field(default_factory=set, compare=False)

    @classmethod
    def of(cls, method: Callable[..., Any]) -> _Shape:
        params = list(inspect.signature(method).parameters.values())
        named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        return cls(
            names=tuple(p.name for p in named if p.kind is p.POSITIONAL_OR_KEYWORD),
            required=frozenset(p.name for p in named if p.default is p.empty),
            keywords=frozenset(p.name for p in named),
        )

    def check(self, args: list[Any], kwargs: dict[str, Any]) -> str | None:
        sent = (len(args), tuple(kwargs))
        if sent in self.fine:
            return None
        problem = self._problem(args, kwargs)
        if problem is None and len(self.fine) < _SHAPES_KEPT:
            self.fine.add(sent)
        return problem

    def _problem(self, args: list[Any], kwargs: dict[str, Any]) -> str | None:
        if len(args) > len(self.names):
            return f"takes at most {len(self.names)} positional arguments, got {len(args)}"
        unknown = kwargs.keys() - self.keywords
        if unknown:
            return f"unexpected keyword argument {sorted(unknown)[0]!r}"
        by_position = self.names[: len(args)]
        twice = set(by_position) & kwargs.keys()
        if twice:
            return f"multiple values for argument {sorted(twice)[0]!r}"
        missing = self.required - set(by_position) - kwargs.keys()
        if missing:
            return f"missing required argument {sorted(missing)[0]!r}"
        return None


@dataclass(eq=False)
class _Request:
    connection: _Connection
    id: Any
    method: str
    args: list[Any]
    kwargs: dict[str, Any]
    rows: Callable[[Any], list[sqltext.Row]] | None  # set for SQL text: answer as rows
    received: float
    refused: QueueError | None = None  # refused before it reached the store
    dispatch: bool = False  # ADD_AND_RETRIEVE: hand what it retrieves to the pool
    # An ADD sent with the RESULT_BLOCKING that follows it (its request id, its timeout):
    # the long poll waits on the id the ADD answers.
    then_wait: tuple[int, int] | None = None
    follows: _Request | None = None  # that long poll: the ADD it follows
    added_id: int | None = None  # the ADD's answered id, once it ran
    started_ms: int | None = None  # the fast track: startQueryTime, recorded in its batch
    checked: bool = False  # by `_take_batch`, once
    pool_step: bool = False  # a worker's step of a pool job (`_note_acks`): not held


def _moves_pool(command: Command | None, full: bool) -> bool:
    """Whether a command, done, may give the pool something to retrieve: it frees a slot,
    or adds work while the pool has one (an ADD alone changes nothing while the pool
    holds its budget, `WorkerPool.full`)."""
    return command is not None and (command.frees_slot or (command.adds and not full))


def _ends_or_waits(request: _Request) -> bool:
    """A command by queue id that a worker's ACK comes after: the ACK itself, or one it
    waits for the answer of before it ACKs (the cancel handler's extra). Not a
    heartbeat: a worker beats on its own, and ACKs without waiting for the beat."""
    return request.method != "heartbeat" and bool(request.args) and isinstance(request.args[0], int)


class _Deadline:
    """Resolves `waiter` at `until` (`time.monotonic()`). The loop's timers go by its own
    clock, in whole ms on uvloop and read once a loop turn, so one may fire a good part of
    a ms early: it is armed again for what is left."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, until: float, waiter: asyncio.Future[None]
    ) -> None:
        self._loop, self._until, self._waiter = loop, until, waiter
        self._timer = loop.call_later(until - time.monotonic(), self._fire)

    def _fire(self) -> None:
        left = self._until - time.monotonic()
        if left > 0:
            self._timer = self._loop.call_later(left, self._fire)
        elif not self._waiter.done():
            self._waiter.set_result(None)

    def cancel(self) -> None:
        self._timer.cancel()


def _coming(*queued: Iterable[_Request]) -> set[QueueId]:
    """The queue ids whose worker's ACK is among `queued`, or comes after a command there
    that the worker waits for (`_ends_or_waits`): a linger does not wait for those."""
    return {r.args[0] for requests in queued for r in requests if _ends_or_waits(r)}


def _acks_last(batch: list[_Request]) -> list[_Request]:
    """A lane's batch with the commands of connections that sent an ACK after all the
    others, each connection's in the order they came. ACKs by queue id have their items
    read ahead with the batch's lock (`expect`), while an ADD reads as it runs: run first,
    the ADD's read waits for the ACKs' reads too (one round trip where ACK-then-ADD took
    two). Commands of different connections that arrived together have no order between
    them (they could as well have been read from their sockets the other way round)."""
    acking, others = _acking_apart(batch)
    return others + acking if acking and others else batch


def _acking_apart(batch: list[_Request]) -> tuple[list[_Request], list[_Request]]:
    """(The commands of the connections that sent an ACK in `batch`, the others), each
    in the order they came."""
    acking = {id(r.connection) for r in batch if r.method == "ack"}
    if not acking:
        return [], batch
    return [r for r in batch if id(r.connection) in acking], [
        r for r in batch if id(r.connection) not in acking
    ]


def _then_wait(value: Any) -> tuple[int, int] | None:
    """ADD's `then_wait`: [the request id of the RESULT_BLOCKING to run next, its timeout]."""
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        or value[1] < 0
    ):
        raise InvalidCommandError(
            "then_wait: takes [a request id, a timeout in ms >= 0] for the RESULT_BLOCKING "
            "of the id the ADD answers"
        )
    return value[0], value[1]


def _follow_up(add: _Request) -> _Request:
    """The RESULT_BLOCKING sent with `add` (`then_wait`): its key is the id the ADD
    answers, filled in by `_follow_key` once the ADD has run."""
    assert add.then_wait is not None
    wait_id, timeout_ms = add.then_wait
    return _Request(
        add.connection, wait_id, "result_blocking", [None, timeout_ms], {}, None, add.received,
        follows=add,
    )  # fmt: skip


def _follow_key(request: _Request) -> None:
    add = request.follows
    if add is None:
        return
    if add.added_id is None:
        raise InvalidCommandError("result_blocking: the ADD it follows failed")
    request.args[0] = add.added_id


def _poll_args(request: _Request) -> tuple[Any, int]:
    """RESULT_BLOCKING's key and timeout, however the client passed them (checked by the
    store when the request first ran)."""
    args, kwargs = request.args, request.kwargs
    key = args[0] if args else kwargs["key"]
    timeout_ms = args[1] if len(args) > 1 else kwargs["timeout_ms"]
    return key, int(timeout_ms)


def _budget(queue: Any, method: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """A queue this supervisor's pool runs (`queue`, the pool's) has the pool's concurrency,
    whatever the client's code says: a caller's own QueueApp cannot raise its budget."""
    key = args[0] if args else kwargs.get("key", kwargs.get("path"))
    if queue is None or not isinstance(key, str) or key.rpartition(":")[0] != queue.prefix:
        return
    if method == "add_and_retrieve" and len(args) >= 3:
        args[2] = queue.concurrency
    else:
        kwargs["concurrency"] = queue.concurrency


def _fast_tracked_answer(answer: AddAndRetrieveResponse) -> AddAndRetrieveResponse:
    # Without the retrieved query: the caller sent it and the pool runs the store's
    # copy, so echoing it (a query's SQL can be kilobytes) would cost every fast-tracked
    # query a copy on the wire and a parse in the caller for nothing. Built, not
    # dataclasses.replace: that walks the fields on every fast-tracked query.
    return AddAndRetrieveResponse(
        answer.id, answer.added, answer.pending, answer.active, None, None, True
    )


class QueueServer:
    def __init__(
        self,
        store: QueueStore,
        socket_path: str | Path,
        *,
        tcp_host: str | None = None,
        tcp_port: int | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        max_batch: int = 512,
        pool: WorkerPool | None = None,
        segments: SegmentPool | None = None,
        tcp_token: str | None = None,
        limits: Limits | None = None,
        purge_interval: float = 10.0,
        hold_adds_s: float = HOLD_ADDS_S,
        defer_add_answers_s: float = DEFER_ADD_ANSWER_S,
        poll_s: float = POLL_S,
    ) -> None:
        if tcp_host is not None and tcp_host not in ("127.0.0.1", "::1", "localhost"):
            raise ValueError(f"the TCP listener is for loopback only, not {tcp_host!r}")
        if tcp_host is not None and not tcp_token:
            # Any local user can reach a loopback port: without a secret, they could read
            # every payload and result.
            raise ValueError("the TCP listener needs an auth token (--auth-token-file)")
        self.tcp_token = tcp_token
        self.limits = limits or Limits()
        self.purge_interval = purge_interval
        self.hold_adds_s = hold_adds_s
        self.defer_add_answers_s = defer_add_answers_s
        if poll_s < 0:
            raise ValueError(f"poll_s must be 0 (off) or more, not {poll_s!r}")
        self.poll_s = poll_s
        self.store = store
        self.socket_path = Path(socket_path)
        self.tcp_host = tcp_host
        self.tcp_port = tcp_port
        self.max_frame = max_frame
        self.max_batch = max_batch
        self.stats = Stats()
        # Set by `--http` (metrics.py): fed from the answers; None costs nothing.
        self.metrics: Any | None = None
        self.pool = pool
        if pool is not None:
            pool.noted = self._note
        # The server's own commands (its workers' notes) come from here; answered to
        # nobody (closed), and not in the clients' command stats.
        self._own: _Connection | None = None
        self.segments = segments or SegmentPool(
            name_prefix(socket_path), result_ttl=store.result_ttl_ms / 1000
        )
        self._servers: list[asyncio.Server] = []
        # What arrived, in order; a loop turn (`_execute_turn`) takes it as one batch.
        self._inbox: deque[_Request] = deque()
        self._held: list[_Request] = []  # ADDs waiting for the next batch (_may_hold)
        self._held_timer: asyncio.TimerHandle | None = None
        # Taken for a batch that ended early (`_gives_work`): they run next, first.
        self._carried: deque[_Request] = deque()
        # The next batch's loop turn, once scheduled, on the loop that runs batches (set
        # from start to stop).
        self._turn: asyncio.Handle | None = None
        self._executing_on: asyncio.AbstractEventLoop | None = None
        self._lanes_busy: set[asyncio.Task[None]] = set()
        # A prefix whose batch is on its lane: what arrived for it since (`_to_lane`).
        self._lane_queued: dict[str, list[_Request]] = {}
        # The pool prefix's batches (on its lane, or the loop's turns for a store on the
        # loop): how long they and its workers' ACKs take, and the ACKs its next batch
        # waits for, if it does (linger.py).
        self.linger = Linger(share=0.5 if store.blocking else 1.0)
        self._lingering: dict[str, tuple[asyncio.Future[None], set[Any]]] = {}
        # A store on the loop: the ACKs the loop's next turn waits for (`_lingers`).
        self._awaited_acks: set[QueueId] | None = None
        # A store on the loop: polling for an ACK or a caller's next command due soon
        # (`_poll_for_acks`, `_poll_for_commands`).
        self._polling = loops.Polling()
        # When callers were last answered (None: a command came since), and how soon their
        # next command usually follows (`_poll_for_commands`).
        self._answered_at: float | None = None
        self._next_command = Gap()
        self._connections: set[_Connection] = set()
        self._to_flush: list[_Connection] = []  # `_flush_soon`'s, this loop iteration's
        self._flush_pass: asyncio.Handle | None = None  # that write pass, once scheduled
        self._handlers: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._shapes: dict[str, _Shape] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._socket_lock: guard.Lock | None = None
        self._nudge_scheduled = False
        self._stop_watching: Callable[[], None] | None = None
        self._socket_identity: tuple[int, int] | None = None
        self._deadlines: Deadlines[ParkedPoll] | None = None  # parked polls' (start)
        # The last ACK event's answer as JSON, for every poll it wakes (`_answer`).
        self._encoded_for: tuple[AckEvent, bytes] | None = None
        self._gate: SyncGate | None = None  # set by start, for a store syncing in the background
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
        self._stop_watching = self.store.watch_slots(self._nudge_soon)
        # A blocking store runs a batch's long polls' first look on its lane: their waiters
        # belong to this loop.
        self.store.waiters.home = asyncio.get_running_loop()
        self._deadlines = parked_deadlines(self.store.waiters.home)
        # Coming back after a crash: executors that lived through the outage could not
        # heartbeat, so give them a full timeout to reconnect before anything is reaped.
        self.store.refresh_active_heartbeats()
        self.segments.adopt()  # large results a crashed supervisor acknowledged
        self._executing_on = asyncio.get_running_loop()
        if self.store.background_sync:
            self._gate = SyncGate(
                self.store, self._executing_on, self._store_failed, expecting=self._pool_runs
            )
        self._schedule_turn()  # what arrived before start (nothing can have, but in case)
        self._sweeper = asyncio.ensure_future(self._sweep_forever())

    def _pool_runs(self) -> bool:
        """Whether the pool holds a query, whose ACK will commit soon (synced.py)."""
        return self.pool is not None and self.pool.held > 0

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
            await asyncio.sleep(min(0.5, self.purge_interval))
            self.segments.sweep()
            if self.pool is not None:
                # Batches retrieve for the pool themselves; its reconcile (stalled and
                # orphaned items, anything a batch could not take) still runs this often.
                self.pool.poke()
            if time.monotonic() - purged_at >= self.purge_interval:
                purged_at = time.monotonic()
                # ACKs purge as they go; this keeps an idle queue from holding its dead.
                try:
                    await self.store.run_off_loop(self.store.purge_expired)
                except QueueError as exc:
                    _log.warning("purging expired results failed: %s", exc)

    @property
    def tcp_address(self) -> tuple[str, int] | None:
        for server in self._servers[1:]:
            host, port = server.sockets[0].getsockname()[:2]
            return str(host), int(port)
        return None

    async def stop(self) -> None:
        """Stop accepting, answer parked long-polls with their timeout answer, finish what
        has arrived, then checkpoint the WAL."""
        self._stopping = True
        for server in self._servers:
            server.close()
        for waiter, _ in self._lingering.values():  # what lingers runs now
            if not waiter.done():
                waiter.set_result(None)
        for connection in list(self._connections):
            for task in list(connection.parked):
                task.cancel()
        await asyncio.sleep(0)
        self._release_held()
        self._executing_on = None
        if self._turn is not None:  # a lingering turn too: it runs now
            self._turn.cancel()
            self._turn = None
        self._awaited_acks = None
        while self._carried or self._inbox:
            self._run_batch()
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        await asyncio.gather(*self._lanes_busy, return_exceptions=True)
        if self._gate is not None:
            for connection in list(self._connections):
                self._gate.release_now(connection)  # one sync, for all of them
        readers = [connection.reader for connection in self._connections]
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
        if self._deadlines is not None:
            self._deadlines.close()
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
        for connection in list(self._connections):
            connection.cut_off()
        self.failed.set()

    # -- connections ----------------------------------------------------------------------------

    def _reader(self, *, authenticated: bool) -> FrameReader:
        return FrameReader(
            _Client(self, authenticated), self.max_frame, high_water=self.limits.high_water
        )

    def _held_back(self, connection: _Connection) -> bool:
        """Read no more from a client while its unsent answers pass the high-water mark
        or too many of its requests wait for theirs."""
        limits = connection.limits
        held = not connection.closed and (
            connection.in_flight >= limits.max_in_flight
            or connection.reader.writing_paused
            or connection.buffered() > limits.high_water
        )
        if held and not connection.throttled:
            self.stats.throttled += 1
        connection.throttled = held
        return held

    def _lost(self, connection: _Connection) -> None:
        connection.closed = True
        if self._gate is not None:
            self._gate.forget(connection)
        for parked in list(connection.parked):
            parked.cancel()
        self._connections.discard(connection)
        self.segments.drop_owner(connection)

    def _accept(self, connection: _Connection, body: bytes) -> None:
        if self._answered_at is not None and not connection.worker:
            self._command_arrived(self._answered_at)
        request_id: Any = None
        try:
            message = orjson.loads(body)
            if not isinstance(message, dict):
                raise InvalidCommandError("a request must be a JSON object")
            request_id = message.get("id")
            if not connection.authenticated:
                self._authenticate(connection, message, request_id)
                return
            request = self._parse(connection, message, request_id)
        except orjson.JSONDecodeError as exc:
            connection.send(
                {
                    "id": None,
                    "error": error_payload(InvalidCommandError(f"frame is not JSON: {exc}")),
                }
            )
            return
        except QueueError as exc:
            connection.send({"id": request_id, "error": error_payload(exc)})
            return
        if request is None:
            return
        self._enqueue(request)
        if request.then_wait is not None:
            # In the same batch as its ADD, or the next: it reads the id the ADD answered.
            self._enqueue(_follow_up(request))

    def _enqueue(self, request: _Request) -> None:
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
            if self.store.blocking and request.follows is None:
                self._park(request, asyncio.ensure_future(self._result_blocking(request)))
                return
            # Its first look runs in the batch (a savepoint of the batch's transaction, not
            # a transaction of its own); not found, it parks as the batch is answered.
            connection.polls_queued += 1
        connection.in_flight += 1
        if self._may_hold(request):
            self._hold(request)
            return
        self._release_held()  # ahead of this one: the arrival order stands
        self._inbox.append(request)
        if self.pool is not None and not self.store.blocking and _ends_or_waits(request):
            self._arrived_by_id(request, self.pool)
        self._schedule_turn()

    def _arrived_by_id(self, request: _Request, pool: WorkerPool) -> None:
        """A store on the loop: an ACK tells the linger how long its query took from its
        hand-off; if the loop's turn lingers for it (or for the ACK that follows a command
        its worker waits for, `_ends_or_waits`), the wait is over for it. The last one
        awaited: the turn runs in this loop iteration, after its other reads (what else
        arrived with it joins it)."""
        if request.method == "ack":
            job = pool.job(request.args[0])
            if job is not None:
                self._ack_arrived(job.sent_at)
        awaited = self._awaited_acks
        if awaited is None:
            return
        awaited.discard(request.args[0])
        if not awaited and self._turn is not None:
            self._turn.cancel()
            self._turn = self._loop().call_soon(self._lingered)

    def _ack_arrived(self, sent_at: float | None) -> None:
        """A worker's ACK arrived for a query handed to it at `sent_at`: the linger learns
        how long that took, and the poll for it is over (its turn polls again if another
        is due)."""
        self._polling.stop()
        if sent_at is not None:
            self.linger.acked(sent_at, time.monotonic())

    def _may_hold(self, request: _Request) -> bool:
        """An ADD for the pool's queue while the pool holds its budget cannot be retrieved
        before a slot frees, and its caller waits for the result, not for this answer: it
        waits (at most `hold_adds_s`) to run in the batch of the ACK that frees the slot.
        Each SQLite transaction writes the same ~6 pages however many ADDs it holds (a
        COMMIT's cost); this takes the ADD-only transactions away under load. The long
        poll sent with it waits with it."""
        if self._held and request.follows is self._held[-1]:
            return True
        pool = self.pool
        if (
            self.store.blocking  # lanes group a prefix's commands already
            or pool is None
            or pool.queue is None
            or self._stopping
            or self.hold_adds_s <= 0
            or len(self._held) >= self.max_batch
            or request.refused is not None
        ):
            return False
        return pool.full and self._adds_to_pool(request)

    def _adds_to_pool(self, request: _Request) -> bool:
        """An ADD (or ADD_AND_RETRIEVE) for the prefix of the pool's queue."""
        command = COMMANDS.get(request.method)
        return (
            command is not None
            and command.adds
            and self.pool is not None
            and route_of(tuple(request.args)) == self.pool.prefix
        )

    def _flush_soon(self, connection: _Connection) -> None:
        """Write `connection`'s answers in this loop iteration's pass. One pass, not a
        callback per connection: the long polls an ACK woke (their futures' callbacks,
        queued ahead of the pass by the same turn) are written in it, not an iteration
        later, and before their worker's ACK answer."""
        if not self._to_flush:
            self._flush_pass = self._loop().call_soon(self._flush_all)
        self._to_flush.append(connection)

    def _flush_after_wake_ups(self) -> None:
        """The long polls a batch woke have their callbacks queued now: a write pass that
        was scheduled before them (an ADD's deferred answer released earlier in this
        iteration, say) goes after them, so that they are written in it, ahead of the
        batch's ACK answers."""
        if self._flush_pass is not None:
            self._flush_pass.cancel()
            self._flush_pass = self._loop().call_soon(self._flush_all)

    def _flush_all(self) -> None:
        self._flush_pass = None
        connections, self._to_flush = self._to_flush, []
        # Callers first: an answer ends a caller's wait; a worker's ACK answer only lets it
        # wait for a hand-off, which, if there is one, left already (and each write
        # that wakes a process costs the loop tens of microseconds).
        answered = False
        for connection in connections:
            if not connection.worker:
                connection.flush()
                answered = True
        for connection in connections:
            if connection.worker:
                connection.flush()
        if answered:
            self._poll_for_commands()

    def _loop(self) -> asyncio.AbstractEventLoop:
        # Kept since start: on 3.11 each get_running_loop() is a getpid() system call.
        return self._executing_on or asyncio.get_running_loop()

    def _hold(self, request: _Request) -> None:
        self._held.append(request)
        if self._held_timer is None:
            self._held_timer = self._loop().call_later(self.hold_adds_s, self._release_held)

    def _release_held(self) -> None:
        if self._held_timer is not None:
            self._held_timer.cancel()
            self._held_timer = None
        if self._held:
            self._inbox.extend(self._held)
            self._held.clear()
            self._schedule_turn()

    @staticmethod
    def _park(request: _Request, parked: asyncio.Task[None]) -> None:
        request.connection.parked.add(parked)
        parked.add_done_callback(request.connection.parked.discard)

    def _authenticate(
        self, connection: _Connection, message: dict[str, Any], request_id: Any
    ) -> None:
        """A TCP connection's first frame must be `{"cmd": "auth", "args": [token]}`;
        anything else is answered with an error and the connection closed."""
        args = message.get("args")
        token = (
            args[0] if message.get("cmd") == "auth" and isinstance(args, list) and args else None
        )
        if (
            isinstance(token, str)
            and self.tcp_token is not None
            and hmac.compare_digest(token.encode(), self.tcp_token.encode())
        ):
            connection.authenticated = True
            connection.send({"id": request_id, "ok": True}, after_sync=False)
            return
        error = AuthenticationError(
            "authenticate first: send {'cmd': 'auth', 'args': [token]} with the token "
            "from the supervisor's --auth-token-file"
            if message.get("cmd") != "auth"
            else "auth: wrong token"
        )
        connection.send({"id": request_id, "error": error_payload(error)})
        connection.hang_up = True

    def _parse(
        self, connection: _Connection, message: dict[str, Any], request_id: Any
    ) -> _Request | None:
        received = time.monotonic()
        if "sql" in message:
            parsed = sqltext.parse(message["sql"])
            method, args, kwargs, rows = parsed.method, parsed.args, parsed.kwargs, parsed.rows
        else:
            cmd = message.get("cmd")
            args = message.get("args", [])
            kwargs = message.get("kwargs", {})
            rows = None
            if not isinstance(cmd, str):
                raise InvalidCommandError("a request needs a 'cmd' (or 'sql') string")
            method = cmd
            if not isinstance(args, list) or not isinstance(kwargs, dict):
                raise InvalidCommandError(f"{method}: 'args' must be a list and 'kwargs' an object")
            if method not in COMMANDS:
                self._serve_own(connection, request_id, method, args, kwargs)
                return None
        dispatch = method == "add_and_retrieve" and kwargs.pop("dispatch", False) is True
        if method in _BUDGETED and self.pool is not None:
            _budget(self.pool.queue, method, args, kwargs)
        then_wait = _then_wait(kwargs.pop("then_wait", None)) if COMMANDS[method].adds else None
        if COMMANDS[method].take_process_id and "process_id" not in kwargs:
            kwargs["process_id"] = connection.process_id
        shape = self._shapes.get(method)
        if shape is None:
            shape = self._shapes[method] = _Shape.of(getattr(self.store, method))
        problem = shape.check(args, kwargs)
        if problem is not None:
            raise InvalidCommandError(f"{method}: wrong arguments ({problem})")
        return _Request(
            connection,
            request_id,
            method,
            args,
            kwargs,
            rows,
            received,
            dispatch=dispatch,
            then_wait=then_wait,
        )

    def _serve_own(
        self,
        connection: _Connection,
        request_id: Any,
        method: str,
        args: list[Any],
        kwargs: dict[str, Any],
    ) -> None:
        """The server's own commands, not the queue's: answered at once, none in a batch."""
        if method == "hello":
            if kwargs.get("process_id") is not None:
                try:  # the store's own rule for process ids
                    connection.process_id = check_process_id(kwargs["process_id"])
                except InvalidCommandError:
                    raise InvalidCommandError(
                        "hello: process_id must be a string of 1 to 96 characters"
                    ) from None
            # The prefixes whose queries this supervisor's pool runs: a client hands
            # those off instead of running them itself.
            pool = [self.pool.prefix] if self.pool is not None and self.pool.prefix else []
            # Nothing committed is in it: it need not wait for a sync (synced.py).
            hello = {"pid": os.getpid(), "pool": pool}
            connection.send({"id": request_id, "ok": hello}, after_sync=False)
            return
        if method == "ping":
            connection.send({"id": request_id, "ok": "pong"}, after_sync=False)
            return
        if method == "stats":
            self._soon(self._describe_to(connection, request_id))
            return
        if method == "shm_alloc":
            slot = self.segments.alloc(args[0] if len(args) == 1 else None, connection)
            connection.send({"id": request_id, "ok": slot}, after_sync=False)
            return
        if method == "shm_release":
            if len(args) not in (2, 3):
                raise InvalidCommandError(
                    "shm_release: takes a segment name, its generation and, for a "
                    "view, whether it is closed"
                )
            closed = args[2] if len(args) == 3 else None
            self.segments.release(args[0], args[1], connection, closed)
            connection.send({"id": request_id, "ok": True})
            return
        if method == "shm_view":
            if len(args) != 2:
                raise InvalidCommandError("shm_view: takes a segment name and generation")
            self.segments.mark_viewed(args[0], args[1], connection)
            connection.send({"id": request_id, "ok": True})
            return
        if method == "dispatch":
            self._soon(self._dispatch_to(connection, request_id, args))
            return
        if method == "watch":
            if len(args) != 1:
                raise InvalidCommandError("watch: takes a prefix")
            connection.watching.add(check_prefix(args[0]))
            connection.send({"id": request_id, "ok": True})
            return
        raise InvalidCommandError(f"unknown command {method!r}")

    def _soon(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)

    async def _describe_to(self, connection: _Connection, request_id: Any) -> None:
        try:
            connection.send({"id": request_id, "ok": await self.describe()})
        except QueueError as exc:
            connection.send({"id": request_id, "error": error_payload(exc)})

    async def _dispatch_to(self, connection: _Connection, request_id: Any, args: list[Any]) -> None:
        received = time.monotonic()
        try:
            await self._dispatch(args)
            connection.send({"id": request_id, "ok": True})
            self.stats.record("dispatch", time.monotonic() - received, True)
        except QueueError as exc:
            connection.send({"id": request_id, "error": error_payload(exc)})
            self.stats.record("dispatch", time.monotonic() - received, False)

    async def _dispatch(self, args: list[Any]) -> None:
        """A client's fast track retrieved an item: run it in the pool. Only the item's
        name is taken; what runs is the query as this store holds it, and only if it is
        active and not already handed off."""
        if self.pool is None:
            raise InvalidCommandError(
                "dispatch: this supervisor has no worker pool (start it with --app and --workers)"
            )
        if (
            len(args) != 2
            or not isinstance(args[0], str)
            or not isinstance(args[1], int)
            or isinstance(args[1], bool)
        ):
            raise InvalidCommandError("dispatch: takes an item's path and its queue id")
        path, queue_id = args
        check_key(path)
        check_key(queue_id)
        prefix, _, query_key_hash = path.rpartition(":")
        active = await self.store.run_off_loop(self.store.active, prefix)
        if not any(row.queue_id == queue_id for row in active):
            raise InvalidCommandError(f"dispatch: {path} ({queue_id}) is not an active item")
        query = decode_def(await self.store.run_off_loop(self.store.get, queue_id))
        if query is None:
            raise InvalidCommandError(f"dispatch: {path} ({queue_id}) is not an active item")
        try:
            self.pool.submit(prefix, RetrievedQuery(query_key_hash, queue_id, queue_id, 0, query))
        except RuntimeError as exc:
            raise InvalidCommandError(f"dispatch: {exc}") from None

    def _may_fast_track(self, request: _Request) -> bool:
        """ADD_AND_RETRIEVE asked to `dispatch`, for a prefix this pool runs."""
        return (
            request.dispatch
            and self.pool is not None
            and request.args[0].rpartition(":")[0] == self.pool.prefix
        )

    def _fast_tracked(self, request: _Request, answer: Any) -> bool:
        """... and it retrieved the item it added."""
        return self._may_fast_track(request) and answer.payload is not None and answer.extra is None

    def _dispatch_retrieved(
        self, path: str, answer: AddAndRetrieveResponse, started_ms: int | None
    ) -> Any:
        """The fast track: what ADD_AND_RETRIEVE retrieved (committed) goes to the pool
        now, in this loop turn. The query is the store's own answer, not the client's."""
        assert self.pool is not None
        prefix, _, query_key_hash = path.rpartition(":")
        if self.pool.holds(answer.id):  # handed over as its COMMIT left
            return _fast_tracked_answer(answer)
        query = orjson.loads(answer.payload) if answer.payload is not None else None
        if not isinstance(query, dict):
            return answer
        try:
            self.pool.submit(
                prefix,
                RetrievedQuery(
                    query_key_hash, answer.id, answer.id, answer.pending, query, started_ms
                ),
            )
        except RuntimeError:
            return answer  # stopping: the client's own hand-off fails the same way, and says so
        return _fast_tracked_answer(answer)

    async def describe(self) -> dict[str, Any]:
        pool = {"pool": self.pool.describe()} if self.pool is not None else {}
        wal = self.store.wal_state()
        return {
            **pool,
            **self.stats.snapshot(),
            **(await self.store.run_off_loop(self.store.describe)),
            "shared_memory": self.segments.describe(),
            "connections": len(self._connections),
            "long_polls": sum(len(c.parked) for c in self._connections),
            "pid": os.getpid(),
            "event_loop": loops.running_name(),
            "collector": loops.collector_state(),
            "files": self.store.files(),
            **({"wal": {**wal, **self._held_for_sync()}} if wal is not None else {}),
        }

    def _held_for_sync(self) -> dict[str, int]:
        return {"answers_held_for_sync": self._gate.held} if self._gate is not None else {}

    # -- execution --------------------------------------------------------------------------------

    def _note(self, queue_id: QueueId, extra: str) -> None:
        """A worker's note (the cancel handler its query set, carried by its watch): a
        MERGE_EXTRA of the server's own, in the next batch with whatever else came, on
        every store (a refused one is answered to nobody)."""
        if self._own is None:
            self._own = _Connection(self._reader(authenticated=True), lambda _: None, closed=True)
        request = _Request(
            self._own, None, "merge_extra", [queue_id, extra], {}, None, time.monotonic()
        )
        self._enqueue(request)

    def _schedule_turn(self) -> None:
        # A callback, not a task waiting on a queue: no future and no task step per batch.
        # Scheduled with call_soon, it runs after the I/O callbacks of this loop iteration:
        # every connection that had something to say has said it, and it is one batch.
        loop = self._executing_on
        if self._turn is None and loop is not None:
            self._turn = loop.call_soon(self._execute_turn)

    def _execute_turn(self) -> None:
        self._turn = None
        if (self._carried or self._inbox) and (self.store.blocking or not self._lingers()):
            self._run_turn()

    def _lingers(self) -> bool:
        """A store on the loop: whether this turn waits for the ACKs its workers are about
        to send (linger.py), to run with them in one transaction; it runs when they have
        arrived (`_arrived_by_id`) or are overdue. Never while a worker is idle: an ADD
        in the turn may have work for it."""
        pool = self._retrieving_pool()
        if pool is None or not pool.full:
            return False
        now = time.monotonic()
        awaited, until = self.linger.awaited(
            pool.running(), _coming(self._carried, self._inbox), now
        )
        if not awaited:
            return False
        self._awaited_acks = awaited
        # In whole ms on uvloop: an overdue ACK may hold the turn up to a ms longer.
        self._turn = self._loop().call_later(until - now, self._lingered)
        return True

    def _lingered(self) -> None:
        self._turn = None
        self._awaited_acks = None
        if self._carried or self._inbox:
            self._run_turn()

    def _run_turn(self) -> None:
        try:
            batch = self._take_batch()
            if self.store.blocking:
                for route, group in self._by_route(batch).items():
                    self._to_lane(route, group)
            else:
                began = time.monotonic()
                batch, answers, for_pool = self._execute_carrying(batch)
                self._settle(batch, answers, for_pool)
                self.linger.ran(time.monotonic() - began)
                self._poll_for_acks()
        finally:
            # What is left (carried, or arrived meanwhile) goes in the next turn, after the
            # connections have read what arrived since: the next batch groups it.
            if self._carried or self._inbox:
                self._schedule_turn()

    def _poll_for_acks(self) -> None:
        """A store on the loop, its turn settled: if a worker's ACK is due within `poll_s`
        (linger.py), the loop keeps polling its sockets until it arrives or is overdue,
        rather than sleep. On a machine whose idle CPU halts (a VM's vCPU), the wake-up
        that sleeping costs is tens of microseconds, a good part of a short query's round
        trip; queries that take longer than that are never polled for, and neither are
        those of a saturated queue (`WorkerPool.saturated`): the loop hardly sleeps then,
        and its polls' yields gave away the CPU it was short of."""
        pool = self.pool
        if pool is None or not self._may_poll():
            return
        until = self.linger.ack_due(pool.running(), time.monotonic(), self.poll_s)
        if until is not None:
            self._polling.extend(until)

    def _poll_for_commands(self) -> None:
        """A store on the loop, callers answered: if their next command usually follows
        within `poll_s` (a caller that sends its queries one after another), the loop polls
        for it rather than sleep, for `_poll_for_acks`' reasons and with its exceptions."""
        if not self._may_poll():
            return
        now = time.monotonic()
        self._answered_at = now
        until = self._next_command.poll_until(now, self.poll_s)
        if until is not None:
            self._polling.extend(until)

    def _may_poll(self) -> bool:
        """Whether the loop polls at all: on, running, its store on the loop (a PostgreSQL
        store's lane threads would wait for the GIL), and its pool's queue not saturated."""
        return (
            self.poll_s > 0
            and not self._stopping
            and not self.store.blocking
            and not (self.pool is not None and self.pool.saturated)
        )

    def _command_arrived(self, answered_at: float) -> None:
        """A caller's command after answers: how long it took teaches the next poll, and
        this one is over (the turn's end polls again if an ACK is due then)."""
        self._answered_at = None
        self._polling.stop()
        self._next_command.heard(time.monotonic() - answered_at, self.poll_s)

    def _settle(
        self,
        batch: list[_Request],
        answers: list[tuple[bool, Any]],
        for_pool: list[RetrievedQuery] | None,
        effects: list[Callable[[], object]] | None = None,
    ) -> None:
        """A committed batch: the pool hears of it (its workers' next queries leave
        first: their ACKs are what the next batch waits for), then the waiters it woke
        (`effects`, a lane's batch), then its answers."""
        # A write pass scheduled before the batch's waiters were woken (on SQLite they
        # are as it commits) would write its ACK answers ahead of the polls they woke.
        passed_early = self._flush_pass is not None
        self._note_acks(batch, answers)
        self._hand_over(batch, answers, for_pool)
        for effect in effects or ():  # here on the loop
            try:
                effect()
            except Exception:
                _log.exception("waking the waiters of a batch failed")
        # A batch that tried the pool's retrieval did its reconcile's work (found nothing
        # is an answer too): a poke would list ACTIVE and PENDING again for nothing.
        self._answer_batch(batch, answers, poke=for_pool is None)
        if passed_early:
            self._flush_after_wake_ups()

    def _hand_over(
        self,
        batch: list[_Request],
        answers: list[tuple[bool, Any]],
        for_pool: list[RetrievedQuery] | None,
    ) -> None:
        """What a batch gives the pool: its retrieval, then its fast-tracked items (their
        answers marked dispatched). What the pool holds already is not handed over again
        (`_hand_off_as_it_commits`)."""
        self._hand_to_pool(for_pool)
        self._dispatch_fast_tracked(batch, answers)

    def _dispatch_fast_tracked(
        self, batch: list[_Request], answers: list[tuple[bool, Any]]
    ) -> None:
        """The items the batch's ADD_AND_RETRIEVEs retrieved go to the pool with its other
        hand-offs, before any answer is written (not as each is answered, after the
        batch's earlier answers): the fast track leaves no later than the queued path."""
        for i, (request, (ok, answer)) in enumerate(zip(batch, answers, strict=True)):
            if ok and self._fast_tracked(request, answer):
                answers[i] = (
                    True,
                    self._dispatch_retrieved(request.args[0], answer, request.started_ms),
                )

    def _by_route(self, batch: list[_Request]) -> dict[str | None, list[_Request]]:
        """A batch split by the prefix each command is about, in arrival order. A command
        by queue id about an item the pool holds (its workers' ACKs) goes with the pool's
        prefix: into the same transactions as the ADDs and RETRIEVEs it frees a slot for."""
        groups: dict[str | None, list[_Request]] = {}
        held = self.pool.job if self.pool is not None else None
        for request in batch:
            # A long poll sent with its ADD runs with it (it reads the id the ADD answers).
            route = route_of(tuple((request.follows or request).args))
            if route is None and held is not None and request.args:
                job = held(request.args[0]) if isinstance(request.args[0], int) else None
                route = job.path.rpartition(":")[0] if job is not None else None
                if job is not None and request.method == "ack":
                    self._ack_arrived(job.sent_at)
            groups.setdefault(route, []).append(request)
        return groups

    def _to_lane(self, route: str | None, group: list[_Request]) -> None:
        """PostgreSQL: each prefix's commands go to a lane of the store (a thread and a
        connection, in order); the loop does not wait for them, so a prefix waiting on a
        lock holds up neither other prefixes nor pings. While a prefix's batch is on its
        lane, what arrives for it waits and goes as the next batch: one transaction (one
        commit) for all of it. Commands by queue id (no prefix) are not held back: each
        group takes the least loaded lane, as one of them may wait on any prefix's lock."""
        if route is not None and route in self._lane_queued:
            self._lane_queued[route].extend(group)
            lingering = self._lingering.get(route)
            if lingering is not None:
                waiter, awaited = lingering
                # An ACK came, or the worker waits for another command's answer: no ACK
                # comes before the batch answers it.
                awaited.difference_update(r.args[0] for r in group if _ends_or_waits(r))
                if not awaited and not waiter.done():
                    waiter.set_result(None)
            return
        if route is not None:
            self._lane_queued[route] = []
        task = asyncio.ensure_future(self._execute_off_loop(group, route))
        self._lanes_busy.add(task)
        task.add_done_callback(self._lanes_busy.discard)

    async def _execute_off_loop(self, batch: list[_Request], route: str | None) -> None:
        try:
            while batch:
                pool = self._retrieving_pool()
                lingers = route is not None and pool is not None and route == pool.prefix
                if lingers:
                    assert route is not None and pool is not None
                    batch = await self._linger_for_acks(route, batch, pool)
                batch = _acks_last(batch)
                effects: list[Callable[[], object]] = []
                began = time.monotonic()
                try:
                    answers, for_pool, effects = await self.store.run_off_loop(
                        self._execute_deferring, batch, route, route=route
                    )
                except RuntimeError as exc:  # its lanes are shut down: none of it ran
                    answers, for_pool = (
                        [(False, StoreError(f"the store is closed: {exc}"))] * len(batch),
                        None,
                    )
                try:
                    self._settle(batch, answers, for_pool, effects)
                except Exception:  # a bug: the prefix's next commands must still run
                    _log.exception("answering a batch of %d commands failed", len(batch))
                if lingers:
                    self.linger.ran(time.monotonic() - began)
                batch = self._next_for_lane(route)
        except asyncio.CancelledError:
            if route is not None:
                self._lane_queued.pop(route, None)
            raise

    def _execute_deferring(
        self, batch: list[_Request], route: str | None
    ) -> tuple[list[tuple[bool, Any]], list[RetrievedQuery] | None, list[Callable[[], object]]]:
        """`_execute_here` on a lane, its after-commit effects (the waiters its ACKs wake)
        handed back to run on the loop with its answers: waking them from the lane cost
        the loop a wake-up of its own for each (`call_soon_threadsafe`)."""
        with self.store.deferring_effects() as effects:
            answers, for_pool = self._execute_here(batch, route)
        return answers, for_pool, effects

    async def _linger_for_acks(
        self, route: str, batch: list[_Request], pool: WorkerPool
    ) -> list[_Request]:
        """The pool prefix's next batch, once the ACKs of the queries its workers were
        just handed have arrived (or are overdue): one batch for them all (linger.py)."""
        loop = self._loop()
        # Workers with a command here wait for its answer: their ACKs are not coming.
        coming = _coming(batch, self._lane_queued.get(route, ()))
        now = time.monotonic()
        awaited, until = self.linger.awaited(pool.running(), coming, now)
        if not awaited:
            return batch
        waiter: asyncio.Future[None] = loop.create_future()
        self._lingering[route] = (waiter, awaited)
        timer = _Deadline(loop, until, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            del self._lingering[route]
            # Back in front of what arrived meanwhile, taken again as one batch.
            self._lane_queued[route] = batch + self._lane_queued.get(route, [])
        return self._next_for_lane(route)

    def _next_for_lane(self, route: str | None) -> list[_Request]:
        """What arrived for `route` while its batch ran (at most `max_batch`); none left:
        the route is free, its next command starts a lane task of its own."""
        if route is None:
            return []
        queued = self._lane_queued.pop(route, [])
        if queued:
            self._lane_queued[route] = queued[self.max_batch :]
        return queued[: self.max_batch]

    def _note_acks(self, batch: list[_Request], answers: list[tuple[bool, Any]]) -> None:
        """The pool hears of its workers' ACKs as they are answered (committed, or found
        their item gone): the ACK ends a worker's query, and the worker is sent its next
        in this same turn, with no word from it. A worker's steps of the pool's query (its
        ACK, heartbeats, extra) are answered without waiting for a sync (synced.py)."""
        if self.pool is None:
            return
        gated = self._gate is not None
        for request, (ok, _) in zip(batch, answers, strict=True):
            if not (ok and request.args):
                continue
            if request.method == "ack":
                request.pool_step = self.pool.acked(request.args[0])
                if request.pool_step:
                    request.connection.worker = True
            elif gated and request.method in _POOL_STEPS:
                request.pool_step = self.pool.job(request.args[0]) is not None

    def _run_batch(self) -> None:
        """Run what has arrived, here and now (at shutdown)."""
        batch = self._take_batch()
        if batch:
            batch, answers, _ = self._execute_carrying(batch)
            self._dispatch_fast_tracked(batch, answers)
            self._answer_batch(batch, answers)

    def _execute_carrying(
        self, batch: list[_Request]
    ) -> tuple[list[_Request], list[tuple[bool, Any]], list[RetrievedQuery] | None]:
        """`_execute_here` on the loop: a batch may end early (`_gives_work`); what it
        did not run is carried to the next, ahead of anything that arrived since."""
        answers, for_pool = self._execute_here(batch)
        if len(answers) < len(batch):
            self._carried.extendleft(reversed(batch[len(answers) :]))
            batch = batch[: len(answers)]
        return batch, answers, for_pool

    def _take_batch(self) -> list[_Request]:
        batch: list[_Request] = []
        while len(batch) < self.max_batch and self._carried:
            batch.append(self._carried.popleft())
        while len(batch) < self.max_batch and self._inbox:
            batch.append(self._inbox.popleft())
        if not self.store.blocking:
            batch = _acks_first(batch)
        for request in batch:  # checked here, on the loop: the segments live on it
            if request.checked:
                continue  # carried over from a batch that ended early
            request.checked = True
            if request.method == "ack" and len(request.args) == 2:
                try:
                    self.segments.check_ack(request.args[1])
                    if self.store.shared and parse_reference(request.args[1]) is not None:
                        # Other hosts read this store, not our /dev/shm: it keeps the
                        # result itself (shared memory stays a same-host hand-off).
                        request.args[1] = self.segments.take(request.args[1])
                except QueueError as exc:
                    request.refused = exc
        return batch

    def _execute_here(
        self, batch: list[_Request], route: str | None = None
    ) -> tuple[list[tuple[bool, Any]], list[RetrievedQuery] | None]:
        """`_execute` (on the loop, or on a blocking store's lane), and in the same
        transaction, when the batch freed a slot or added work, the pool's retrieval: what
        its reconcile would retrieve next, handed to its workers as soon as the batch
        commits (None: not tried)."""
        try:
            return self.store.batched(
                lambda: self._attempt(batch), self._forget_polls, prefix=route
            )
        except StoreError as exc:
            return [(False, exc)] * len(batch), None

    def _forget_polls(self, done: tuple[list[tuple[bool, Any]], Any]) -> None:
        """A batch that did not commit: the long polls it subscribed wait for nothing."""
        for _, answer in done[0]:
            if isinstance(answer, Waiter):
                self.store.waiters.unsubscribe(answer)

    def _attempt(
        self, batch: list[_Request]
    ) -> tuple[list[tuple[bool, Any]], list[RetrievedQuery] | None]:
        answers: list[tuple[bool, Any]] = []
        self.store.expect((r.method, r.args, r.kwargs) for r in batch if r.refused is None)
        if self.store.blocking:  # a store on the loop reads for nothing ahead
            self._expect_retrieval(batch)
        try:
            done = self._attempt_into(batch, answers)
        except BaseException:
            # Unwound (a store runs the batch again from the start): its long polls so far
            # wait for nothing.
            self._forget_polls((answers, None))
            raise
        self._hand_off_as_it_commits(batch[: len(done[0])], *done)
        return done

    def _hand_off_as_it_commits(
        self,
        batch: list[_Request],
        answers: list[tuple[bool, Any]],
        for_pool: list[RetrievedQuery] | None,
    ) -> None:
        """What the batch gives the pool (the fast track's items, its retrieval) goes to
        the workers as its COMMIT leaves, not once it is done (`before_commit`): a query
        runs while the COMMIT makes its round trip to PostgreSQL, or while SQLite writes
        its WAL; with it, the workers whose ACKs the batch carries are sent their next
        (`_hand_over_committing`). Answers still wait for the commit, and so does the
        pool's word that those ACKs ended their queries (`_note_acks`); `_settle` then
        hands over only what was not. A batch that does not commit after
        all gave a worker a query of nothing (its ACK finds no item: no store hands out
        an id twice, group_commit.py); one run again hands over what it retrieves then."""
        acks = _acked_ids(batch, answers)
        if (
            for_pool
            or (acks and self.pool is not None and self.pool.backlog)
            or any(
                ok and self._fast_tracked(request, answer)
                for request, (ok, answer) in zip(batch, answers, strict=True)
            )
        ):
            # A copy of the answers: the loop marks them dispatched when it settles.
            hand_over = functools.partial(
                self._hand_over_committing, batch, list(answers), for_pool, acks
            )
            if self.store.blocking:  # on a lane: the pool is the loop's
                self.store.before_commit(
                    functools.partial(self._loop().call_soon_threadsafe, hand_over)
                )
            else:
                self.store.before_commit(hand_over)

    def _hand_over_committing(
        self,
        batch: list[_Request],
        answers: list[tuple[bool, Any]],
        for_pool: list[RetrievedQuery] | None,
        acks: list[QueueId],
    ) -> None:
        """`_hand_over` as the batch's COMMIT starts, where the workers whose ACKs it
        carries take their next at once (`WorkerPool.acking`, here on the loop): they start
        it while the COMMIT is made, not once their ACK is answered."""
        if self.pool is not None:
            for queue_id in acks:
                self.pool.acking(queue_id)
        self._hand_over(batch, answers, for_pool)

    def _attempt_into(
        self, batch: list[_Request], answers: list[tuple[bool, Any]]
    ) -> tuple[list[tuple[bool, Any]], list[RetrievedQuery] | None]:
        added: set[int] = set()  # the ADDs of this transaction that inserted their item
        split = -1 if self.store.blocking or self._retrieving_pool() is None else _acking_end(batch)
        early: list[RetrievedQuery] | None = None
        for i, request in enumerate(batch):
            if i == split:
                early = self._hand_off_early(batch[:i], answers, batch[i:])
            if request.follows is not None and id(request.follows) in added:
                answers.append(self._wait_for_new(request))
                continue
            answers.append(self._run(request))
            ok, answer = answers[-1]
            if ok and request.then_wait is not None and answer.added:
                added.add(id(request))
            if i + 1 < len(batch) and self._gives_work(request, ok, answer):
                if batch[i + 1].follows is request:  # its long poll: in this batch
                    answers.append(self._wait_for_new(batch[i + 1]))
                break
        if early and self.pool is not None and self.pool.full:
            # The early hand-off filled the budget: only a slot the rest frees is left.
            due = self._pool_retrieval_due(batch[split : len(answers)], answers[split:])
        else:
            due = self._pool_retrieval_due(batch[: len(answers)], answers)
        if due is None:
            return answers, early
        # Nothing pending is found nothing: no listing, and no reconcile poked for it.
        later = self._retrieve_for_pool() if due else []
        return answers, early + (later or []) if early else later

    def _hand_off_early(
        self, done: list[_Request], answers: list[tuple[bool, Any]], rest: list[_Request]
    ) -> list[RetrievedQuery] | None:
        """The batch's workers' ACKs have run, the rest of it has not: the slots they
        freed are filled now, in this transaction, and the workers sent their next before
        the batch's other commands run (its callers' ADDs, their long polls), not as its
        COMMIT leaves. A worker's turnaround bounds a busy queue's throughput. Only with
        the head of PENDING as the end of the batch would find it: nothing below the
        priority of an ADD of the rest (`min_priority`). What it retrieved joins the
        batch's retrieval (None: nothing tried)."""
        acks = _acked_ids(done, answers)
        if not acks or not self._pool_retrieval_due(done, answers):
            return None
        floor = self._priority_floor(rest)
        if floor is False:
            return None
        assert self.pool is not None and self.pool.queue is not None
        got = self._retrieve_for_pool(min_priority=floor)
        if got and self.store.hands_off_early():
            for queue_id in acks:
                self.pool.acking(queue_id)
            self._hand_to_pool(got)
        return got

    def _priority_floor(self, requests: list[_Request]) -> int | Literal[False] | None:
        """The highest priority of the pool's prefix that `requests` may add (None: they
        add none; False: one of them asks for one no item can have)."""
        floor: int | None = None
        for request in requests:
            if self._adds_to_pool(request):
                try:
                    priority = check_priority(request.kwargs.get("priority", 0))
                except QueueError:
                    return False  # its ADD fails: the batch's end retrieves as before
                floor = priority if floor is None else max(floor, priority)
        return floor

    def _expect_retrieval(self, batch: list[_Request]) -> None:
        """Tell the store of the pool's retrieval the batch will likely end with (a slot
        it may free, work it may add), so it can read for it ahead (`expect_retrieval`)."""
        pool = self._retrieving_pool()
        if pool is None or pool.queue is None:
            return
        full = pool.full
        # Not for the fast track's ADD_AND_RETRIEVE: it retrieves what it adds while the
        # prefix has room, which leaves nothing pending to read (an idle query's batch
        # read the head for nothing); where it does not, the retrieval reads it then.
        if any(
            _moves_pool(COMMANDS.get(request.method), full) and not self._may_fast_track(request)
            for request in batch
        ):
            queue = pool.queue
            if self.store.nothing_pending_seen(queue.prefix) and not any(
                (command := COMMANDS.get(request.method)) is not None and command.adds
                for request in batch
            ):
                # A slot freed (an idle queue's ACK) with nothing pending to fill it: the
                # retrieval reads the counts only. Should another host have added work
                # since, it reads the head then, a round trip of its own.
                return
            self.store.expect_retrieval(queue.prefix, queue.process_uid, queue.concurrency)

    def _retrieving_pool(self) -> WorkerPool | None:
        """The pool a batch may retrieve for: one with a queue, neither stopping."""
        pool = self.pool
        if pool is None or pool.queue is None or self._stopping or pool.stopping:
            return None
        return pool

    def _gives_work(self, request: _Request, ok: bool, answer: Any) -> bool:
        """An ADD that inserted work for the pool while it has an idle slot ends its batch
        (on a store that runs batches on the loop): the worker starts once it commits,
        not after everything that arrived with it (a dedup storm's thousand joins)."""
        pool = self.pool
        return (
            ok
            and not self.store.blocking
            and pool is not None
            and pool.queue is not None
            and not pool.full
            and self._adds_to_pool(request)
            and answer.added
        )

    def _wait_for_new(self, request: _Request) -> tuple[bool, Any]:
        """The long poll of an item its ADD inserted in this same transaction: nothing can
        have answered it yet, so it subscribes (before the item is visible to anyone)
        without a look."""
        _follow_key(request)
        return True, self.store.waiters.subscribe(request.args[0])

    def _pool_retrieval_due(
        self, batch: list[_Request], answers: list[tuple[bool, Any]]
    ) -> bool | None:
        """Whether the batch freed a slot or added work for the pool (None: neither), and
        if so whether anything may be pending for it to retrieve."""
        pool = self._retrieving_pool()
        if pool is None:
            return None
        full, prefix = pool.full, pool.prefix
        may = False
        # The pool prefix's pending count as the batch's last command that reports it
        # answered: later ones can only lower it (only an ADD makes an item pending, and
        # an ADD reports it). None pending: nothing to retrieve, no listing to run (the
        # fast track's own batch, an idle queue's).
        pending: int | None = None
        for request, (ok, answer) in zip(batch, answers, strict=True):
            if not ok:
                continue
            may = may or _moves_pool(COMMANDS.get(request.method), full)
            if request.method in _REPORT_PENDING and route_of(tuple(request.args)) == prefix:
                pending = answer.pending if answer is not None else pending
        return (pending != 0) if may else None

    def _retrieve_for_pool(self, min_priority: int | None = None) -> list[RetrievedQuery] | None:
        """The pool queue's reconcile, in the batch: the head of PENDING retrieved per free
        slot (`retrieve_next`), with its process id, its concurrency and the design's rule
        on persistent keys. None: it failed (the reconcile does the rest)."""
        assert self.pool is not None and self.pool.queue is not None
        queue = self.pool.queue
        # startQueryTime in the retrieving write (Cube's processQuery records it right
        # after RETRIEVE): the worker need not send it.
        started = self.store.clock.now_ms()
        try:
            got = self.store.retrieve_next(
                queue.prefix,
                concurrency=queue.concurrency,
                process_id=queue.process_uid,
                start_query_time=started,
                min_priority=min_priority,
            )
        except QueueError as exc:
            _log.warning("retrieving for the pool in the batch failed: %s", exc)
            return None
        return [
            RetrievedQuery(
                item.key,
                item.id,
                item.id,
                item.pending,
                decode_query(item.payload, item.extra),
                started,
            )
            for item in got
        ]

    def _hand_to_pool(self, retrieved: list[RetrievedQuery] | None) -> None:
        if not retrieved or self.pool is None:
            return
        for item in retrieved:
            if self.pool.holds(item.queue_id):
                continue  # handed over as its batch's COMMIT left (`before_commit`)
            try:
                self.pool.submit(self.pool.prefix or "", item)
            except RuntimeError:  # stopping since: the stalled path reclaims it
                self.pool.poke()
                return

    def _answer_batch(
        self, batch: list[_Request], answers: list[tuple[bool, Any]], *, poke: bool = True
    ) -> None:
        """`poke`: tell the pool to reconcile after what changed (False: the batch did
        the pool's retrieval itself)."""
        self.stats.batches += 1
        self.stats.batched_commands += len(batch)
        now = time.monotonic()
        metrics = self.metrics
        if metrics is not None:
            metrics.batch(len(batch))
        # ADDs whose pipelined long poll parks in this batch: their answers wait for its.
        parking = (
            {
                id(request.follows)
                for request, (ok, answer) in zip(batch, answers, strict=True)
                if request.follows is not None and ok and isinstance(answer, Waiter)
            }
            if self.defer_add_answers_s > 0
            else set()
        )
        for request, (ok, answer) in zip(batch, answers, strict=True):
            request.connection.in_flight -= 1
            if request.method == "result_blocking":  # it came through the inbox
                request.connection.polls_queued -= 1
                if ok and isinstance(answer, Waiter):
                    self._park_poll(request, answer)
                    continue
            if request.connection is self._own:
                continue  # the server's own note: nobody to answer or to count it for
            self.stats.record(request.method, now - request.received, ok)
            if metrics is not None:
                self._measure(metrics, request, ok, answer, now - request.received)
            self._answer(request, ok, answer, poke, defer=id(request) in parking)

    def _measure(self, metrics: Any, request: _Request, ok: bool, answer: Any, took: float) -> None:
        if not ok:
            metrics.failed(request.method, took)
            return
        metrics.answered(request.method, request.args, answer, took)
        if request.method == "ack" and len(request.args) == 2 and answer.success:
            # The pool's job for it (ended by this ACK): what ran, and how long it waited.
            job = self.pool.job(request.args[0]) if self.pool is not None else None
            key = request.args[0]
            path = job.path if job is not None else key if isinstance(key, str) else ":"
            metrics.acked(path, request.args[1], job)

    def _run(self, request: _Request) -> tuple[bool, Any]:
        if request.refused is not None:
            return False, request.refused
        try:
            if request.method == "result_blocking":
                _follow_key(request)
                found, waiter = self.store.result_blocking_start(*request.args, **request.kwargs)
                return True, found if waiter is None else waiter
            kwargs = request.kwargs
            if self._may_fast_track(request):
                # The fast track's startQueryTime, written as the pool's own retrieval's is.
                request.started_ms = self.store.clock.now_ms()
                kwargs = {**kwargs, "start_query_time": request.started_ms}
            answer = getattr(self.store, request.method)(*request.args, **kwargs)
            if request.then_wait is not None:
                request.added_id = answer.id
            return True, answer
        except QueueError as exc:
            return False, exc
        except Exception as exc:  # a bug must not take the server down with it
            return False, StoreError(f"{request.method} failed: {exc!r}")

    def _answer(
        self,
        request: _Request,
        ok: bool,
        answer: Any,
        poke: bool = True,
        *,
        defer: bool = False,
        woken_by: AckEvent | None = None,
    ) -> None:
        """`defer`: an ADD whose long poll parked (`_Connection.defer`). `woken_by`: the
        ACK event that answers a parked long poll; every poll it wakes gets the same
        answer, encoded once (a dedup storm's thousand waiters, a large result's copies)."""
        command = COMMANDS.get(request.method)
        if ok and command is not None and (command.adds or command.frees_slot) and self.pool:
            if poke:
                self.pool.poke(freed=command.frees_slot)
            if request.method == "cancel" and answer is not None and request.args:
                self.pool.removed(request.args[0])  # its worker hears of it now
        if ok and request.method == "ack" and len(request.args) == 2:
            self.segments.acked(request.args[1], bool(answer.success))
        elif ok and answer is not None and request.method in ("result", "result_blocking"):
            if request.rows is not None and cube_results.needs_materialising(answer.payload):
                self._soon(self._answer_as_json(request, answer))
                return
            leased = self._lease_result(request, answer)
            if leased is not answer:
                woken_by = None  # its segment is gone: this poll's answer is its own
            answer = leased
        connection = request.connection
        if request.follows is not None and connection.deferred:
            connection.release_deferred(request.follows)  # its ADD's answer goes first
        if not ok:
            connection.send({"id": request.id, "error": error_payload(answer)})
        elif request.rows is not None:
            connection.send({"id": request.id, "rows": request.rows(answer)})
        elif defer:
            connection.defer(request, {"id": request.id, "ok": answer}, self.defer_add_answers_s)
        elif woken_by is not None and (encoded := self._encoded_answer(woken_by, answer)):
            connection.send_answer(request.id, encoded)
        else:
            connection.send({"id": request.id, "ok": answer}, after_sync=not request.pool_step)

    def _encoded_answer(self, event: AckEvent, answer: Any) -> bytes | None:
        cached = self._encoded_for
        if cached is not None and cached[0] is event:
            return cached[1]
        try:
            encoded = encode_body(answer)
        except TypeError:
            return None  # sent the usual way, which answers the error
        if cached is None:  # held for this loop turn's polls, then let go
            self._loop().call_soon(self._forget_encoded)
        self._encoded_for = (event, encoded)
        return encoded

    def _forget_encoded(self) -> None:
        self._encoded_for = None

    def _nudge_soon(self) -> None:
        """A slot may have freed: tell the watching connections, once per loop turn."""
        if not self._nudge_scheduled and self._connections:
            self._nudge_scheduled = True
            self._loop().call_soon(self._nudge)

    def _nudge(self) -> None:
        self._nudge_scheduled = False
        for connection in self._connections:
            for prefix in connection.watching:
                connection.send({"id": None, "nudge": prefix})

    async def _answer_as_json(self, request: _Request, answer: Any) -> None:
        """A SQL-text RESULT of a result a Cube client cannot follow: its JSON text."""
        limit, payload, rows = self.limits.max_sql_result, answer.payload, request.rows
        assert rows is not None
        try:
            ref = parse_reference(payload)
            if ref is None:
                text = await asyncio.to_thread(cube_results.inline_as_json, payload, limit)
            else:
                if ref.size > limit:
                    raise cube_results.too_large(ref.size, limit)
                # A read like any other: leased and released, so its segment goes back to
                # the pool as a client's read would send it.
                owner = object()
                if not self.segments.lease(payload, owner):
                    request.connection.send({"id": request.id, "rows": rows(None)})
                    return
                try:
                    _, data = self.segments.copy_out(payload)
                finally:
                    self.segments.release(ref.name, ref.generation, owner)
                text = await asyncio.to_thread(cube_results.as_json, ref.form, data, limit)
        except QueueError as exc:
            request.connection.send({"id": request.id, "error": error_payload(exc)})
            return
        request.connection.send(
            {"id": request.id, "rows": rows(dataclasses.replace(answer, payload=text))}
        )

    def _lease_result(self, request: _Request, answer: Any) -> Any:
        """A shared-memory result is readable by this connection until it releases it."""
        if parse_reference(answer.payload) is None or request.rows is not None:
            return answer
        if self.segments.lease(answer.payload, request.connection):
            if request.connection.closed:  # a long-poll whose reader hung up meanwhile
                self.segments.drop_owner(request.connection)
            return answer
        # Its segment went back to the pool (a late re-read): as if there were no result.
        return None

    def _park_poll(self, request: _Request, waiter: Waiter) -> None:
        """A long poll whose first look found nothing waits for its ACK's event (at
        shutdown: answered at once, with its timeout answer)."""
        if self.store.blocking:  # its ACK may come from another host: the store waits
            task = asyncio.ensure_future(self._result_blocking(request, waiter))
            self._park(request, task)
            if self._stopping or request.connection.closed:
                task.cancel()
            return
        key, timeout_ms = _poll_args(request)
        parked = request.connection.parked

        def finish(ok: bool, answer: Any, event: AckEvent | None) -> None:
            parked.discard(poll)
            self.stats.record(request.method, time.monotonic() - request.received, ok)
            self._answer(request, ok, answer, woken_by=event)

        assert self._deadlines is not None  # started
        poll = ParkedPoll(self.store, key, timeout_ms, waiter, finish, self._deadlines)
        parked.add(poll)
        if self._stopping or request.connection.closed:
            poll.cancel()

    async def _result_blocking(self, request: _Request, waiter: Waiter | None = None) -> None:
        """A blocking store's long poll; `waiter`: its first look ran in a batch."""
        try:
            if waiter is None:
                answer = await self.store.result_blocking(*request.args, **request.kwargs)
            else:
                key, timeout_ms = _poll_args(request)
                answer = await self.store.result_blocking_wait(key, timeout_ms, waiter)
        except asyncio.CancelledError:
            # Shutdown or hang-up: a parked long-poll gets its timeout answer.
            answer = None
        except QueueError as exc:
            self.stats.record(request.method, time.monotonic() - request.received, False)
            self._answer(request, False, exc)
            return
        finally:
            if waiter is not None:  # cancelled before it ever waited
                self.store.waiters.unsubscribe(waiter)
        self.stats.record(request.method, time.monotonic() - request.received, True)
        self._answer(request, True, answer)
