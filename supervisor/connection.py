"""The supervisor's connections: each client's frames in, its answers out, and its limits.

The I/O shell around the core: a connection reads frames into the server, queues the
answers of a loop iteration for one write, holds answers until their commit is durable
(synced.py), and stops reading a client that does not read its answers.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from queryqueue.driver_socket.frames import FrameReader
from queryqueue.driver_socket.protocol import FrameError, answer_frame, encode_frame, error_payload
from queryqueue.supervisor import cube_results
from queryqueue.supervisor.polls import ParkedPoll
from queryqueue.supervisor.synced import SyncGate


class Served(Protocol):
    """What a connection's frames go to: the server."""

    limits: Limits
    gate: SyncGate | None
    stopping: bool

    def flush_soon(self, connection: Connection) -> None: ...
    def opened(self, connection: Connection) -> None: ...
    def accept(self, connection: Connection, body: bytes) -> None: ...
    def held_back(self, connection: Connection) -> bool: ...
    def lost(self, connection: Connection) -> None: ...


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
    # A result a store several hosts share (PostgreSQL) keeps itself, copied out of shared
    # memory into one row: past this many bytes the ACK is refused at once, naming it, and
    # the query fails with that error (a 256 MiB row outgrew every host's memory).
    max_shared_result: int = 64 * 1024 * 1024


@dataclass(eq=False)
class Connection:
    reader: FrameReader
    # Queues a connection with answers to write for its loop iteration's one write pass
    # (`Answers.flush_soon`).
    flush_soon: Callable[[Connection], None]
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
    # Bytes in `outbox` and `unsynced`, kept as they change: `buffered` is asked before
    # every frame taken, and summing thousands of queued answers each time made a flood
    # of requests quadratic.
    outbox_bytes: int = 0
    unsynced_bytes: int = 0
    # Prefixes whose freed slots this connection wants to hear of (a process waiting to
    # retrieve its own stream item: nobody else may retrieve it for it).
    watching: set[str] = field(default_factory=set)
    in_flight: int = 0
    polls_queued: int = 0  # long polls in the inbox, not yet parked (counted to the limit)
    # Made on the loop. Kept: on 3.11 each get_running_loop() is a getpid() syscall.
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    throttled: bool = False  # not read until its client catches up
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
        return self.transport.get_write_buffer_size() + self.outbox_bytes + self.unsynced_bytes

    def send(self, message: dict[str, Any], *, after_sync: bool = True) -> None:
        """`after_sync`: held until what has committed so far is durable (synced.py)."""
        if self.gone():
            return
        self._queue(frame_of(message), after_sync=after_sync)

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
                self.unsynced_bytes += len(frame)
                gate.hold(self, commit)
                return
        if not self.outbox:
            self.flush_soon(self)
        self.outbox.append(frame)
        self.outbox_bytes += len(frame)

    def release_synced(self, commit: int | None) -> None:
        unsynced = self.unsynced
        while unsynced and (commit is None or unsynced[0][0] <= commit):
            frame = unsynced.popleft()[1]
            self.unsynced_bytes -= len(frame)
            self._queue(frame, after_sync=False)

    def cut_off(self) -> None:
        self.unsynced.clear()
        self.unsynced_bytes = 0
        if not self.gone():
            self.closed = True
            self.transport.abort()

    def flush(self) -> None:
        frames, self.outbox, self.outbox_bytes = self.outbox, [], 0
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


class FrameClient:
    """A connection's frames, to the server (frames.FrameSink)."""

    def __init__(self, server: Served, authenticated: bool) -> None:
        self.server = server
        self.authenticated = authenticated
        self.connection: Connection | None = None

    def opened(self, reader: FrameReader) -> None:
        server = self.server
        self.connection = Connection(
            reader,
            server.flush_soon,
            server.limits,
            authenticated=self.authenticated,
            gate=server.gate,
        )
        server.opened(self.connection)

    def received(self, body: bytes) -> None:
        connection = self.connection
        assert connection is not None
        if self.server.stopping or connection.closed:
            connection.reader.close()
            return
        self.server.accept(connection, body)
        if connection.hang_up:
            connection.reader.close()

    def held_back(self) -> bool:
        assert self.connection is not None
        return self.server.held_back(self.connection)

    def refused(self, error: FrameError) -> None:
        # The stream cannot be resynchronized: say why, then hang up on this client.
        assert self.connection is not None
        self.connection.send({"id": None, "error": error_payload(error)})

    def ending(self) -> None:
        assert self.connection is not None
        connection = self.connection
        if connection.gate is not None:
            connection.gate.release_now(connection)
        connection.flush()  # what was answered before the hang-up still leaves

    def lost(self) -> None:
        if self.connection is not None:
            self.server.lost(self.connection)


def frame_of(message: dict[str, Any]) -> bytes:
    try:
        return encode_frame(message)
    except TypeError as exc:
        return encode_frame({"id": message.get("id"), "error": error_payload(exc)})
