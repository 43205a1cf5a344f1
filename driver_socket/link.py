"""One process's connection to the supervisor: it connects (and reconnects, with bounded
backoff), authenticates over TCP, says hello, and matches each answer to its request.

One connection per process and event loop, shared by every coroutine (requests are
pipelined and matched by id); a forked child or another loop opens its own, never reusing
its parent's socket. A command that was sent but not answered is re-sent only when doing
it twice is harmless (reads, ADD — which deduplicates — and commands that name an item by
its queue id, which is never reused); otherwise the caller gets
`SupervisorUnavailableError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from queryqueue.driver_socket.deadlines import Deadlines
from queryqueue.driver_socket.frames import FrameReader
from queryqueue.driver_socket.protocol import FrameError, encode_frame, raise_error
from queryqueue.engine.aio import runs_here
from queryqueue.engine.commands import served
from queryqueue.engine.errors import (
    AuthenticationError,
    CommandTimeoutError,
    SupervisorUnavailableError,
)

# How long closing a connection waits for it to end.
_HANG_UP_S = 5.0
COMMANDS = served()
# Supervisor commands (not the store's) that are safe to send twice.
_SUPERVISOR_SAFE = {"stats", "ping", "shm_release", "shm_view", "watch"}


class Overdue(Exception):
    """A request's deadline passed unanswered."""


class ConnectionLost(Exception):
    pass


def retry_safe(method: str, args: list[Any], kwargs: dict[str, Any]) -> bool:
    """May this command be sent again after its answer was lost? As the store declares."""
    if method in _SUPERVISOR_SAFE:
        return True
    command = COMMANDS.get(method)
    if command is None or command.resend == "never":
        return False
    if command.resend == "always":
        return True
    return (
        (bool(args) and isinstance(args[0], int))
        or kwargs.get("external_id") is not None
        or kwargs.get("consumer") is not None
    )


class Link:
    """One connection, owned by one process and one event loop. Its answers are taken as
    they arrive (frames.FrameReader calls `received`): a caller's future is settled in the
    loop turn that read its answer, with no reader task woken in between."""

    def __init__(
        self,
        max_frame: int,
        on_nudge: Callable[[str], None] = lambda prefix: None,
    ) -> None:
        self.on_nudge = on_nudge
        # Kept: on 3.11 each get_running_loop() is a getpid() system call, several a request.
        self.loop = asyncio.get_running_loop()
        self.thread = threading.get_ident()
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.reader = FrameReader(self, max_frame)
        self.transport: asyncio.Transport | None = None
        self.alive = True
        self.outbox: list[bytes] = []
        # Every request's deadline in one heap, behind one timer (not a timer and an
        # `asyncio.wait` per call); an answered id is skipped.
        self._deadlines: Deadlines[int] = Deadlines(
            self.loop, expire=self._overdue, live=self.pending.__contains__
        )
        self._keeper = asyncio.ensure_future(self._close_with_the_loop())

    async def _close_with_the_loop(self) -> None:
        """Idle until the connection ends; cancelled with the loop's other tasks when the
        loop ends first (asyncio.run), it hangs up rather than leave its transport to warn
        as it is collected, as a driver its owner never closed would."""
        try:
            await asyncio.shield(self.reader.closed)
        finally:
            if not self.reader.closed.done():
                self.close()

    def answer_within(self, request_id: int, seconds: float) -> None:
        """Fail the request with _Overdue if it is not answered within `seconds`."""
        self._deadlines.add(request_id, seconds)

    def _overdue(self, request_id: int) -> None:
        future = self.pending.pop(request_id, None)
        if future is not None and not future.done():
            future.set_exception(Overdue())

    # -- frames.FrameSink --------------------------------------------------------------------

    def opened(self, reader: FrameReader) -> None:
        self.transport = reader.transport

    def received(self, body: bytes) -> None:
        try:
            reply = orjson.loads(body)
        except ValueError:
            self.close()  # not an answer of ours: nothing after it can be trusted
            return
        if isinstance(reply, dict) and isinstance(reply.get("nudge"), str):
            self.on_nudge(reply["nudge"])  # unsolicited: a slot of a watched prefix
            return
        reply_id = reply.get("id") if isinstance(reply, dict) else None
        future = self.pending.pop(reply_id, None) if isinstance(reply_id, int) else None
        if future is not None and not future.done():
            future.set_result(reply)

    def held_back(self) -> bool:
        return False

    def refused(self, error: FrameError) -> None:
        pass  # the reader hangs up; what was pending fails as the connection ends

    def ending(self) -> None:
        self._fail_pending()

    def lost(self) -> None:
        self._fail_pending()

    def _fail_pending(self) -> None:
        self.alive = False
        pending, self.pending = self.pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(ConnectionLost())

    # -- sending -----------------------------------------------------------------------------

    def send(self, frame: bytes) -> None:
        # Requests made in one loop iteration leave in one write (one syscall).
        if not self.outbox:
            self.loop.call_soon(self._flush)
        self.outbox.append(frame)

    def _flush(self) -> None:
        frames, self.outbox = self.outbox, []
        if not frames or not self.alive or self.transport is None:
            return
        try:
            self.transport.write(b"".join(frames))
        except (ConnectionError, RuntimeError):
            self.close()

    def close(self) -> None:
        self._deadlines.close()
        self.reader.close()  # `ending` fails what is pending, as an end of stream does


def peer_uid(sock: Any) -> int:
    """The uid of the process at the other end of a Unix socket (ours where the platform
    cannot say)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if sock is None or option is None:
        return os.geteuid()
    credentials = sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i"))
    return int(struct.unpack("3i", credentials)[1])


class Connection:
    """The connection of one driver: made on first use, made again after a loss or in a
    forked child, closed with the driver. `on_hello` hears the supervisor's hello on every
    connect, `on_peer` the uid of the process serving the socket."""

    def __init__(
        self,
        socket_path: Path,
        *,
        process_id: str | None,
        reconnect_timeout: float,
        request_timeout: float,
        max_frame: int,
        auth_token: str | None,
        on_hello: Callable[[Link, dict[str, Any]], None],
        on_nudge: Callable[[str], None],
        on_peer: Callable[[int], None],
        source: str = "the one given",
    ) -> None:
        self.socket_path = socket_path
        self.process_id = process_id
        self.reconnect_timeout = reconnect_timeout
        self.request_timeout = request_timeout
        self.max_frame = max_frame
        self.auth_token = auth_token
        self.on_hello, self.on_nudge, self.on_peer = on_hello, on_nudge, on_peer
        self.source = source  # where the socket's path came from, for its errors
        self.ids = itertools.count(1)
        self.link: Link | None = None
        self.reconnects = 0
        self.closed = False
        self._owner: tuple[int, asyncio.AbstractEventLoop] | None = None
        self._connecting: asyncio.Lock | None = None

    def _forget_if_foreign(self) -> None:
        link = self.link
        if link is not None and runs_here(link.loop, link.thread):
            owner = (os.getpid(), link.loop)
        else:
            owner = (os.getpid(), asyncio.get_running_loop())
        if self._owner != owner:
            # A forked child or another loop: the old link belongs to someone else. Drop it
            # without touching it (closing could disturb the parent's connection).
            self.link = None
            self._connecting = asyncio.Lock()
            self._owner = owner

    async def connected(self) -> Link:
        if self.closed:
            raise SupervisorUnavailableError("this driver is closed")
        self._forget_if_foreign()
        link = self.link
        if link is not None and link.alive:
            return link
        assert self._connecting is not None
        async with self._connecting:
            if self.link is not None and self.link.alive:
                return self.link
            self.link = await self._connect()
            return self.link

    async def _connect(self) -> Link:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.reconnect_timeout
        delay = 0.01
        was_connected = self.link is not None
        hello = {} if self.process_id is None else {"process_id": self.process_id}
        while True:
            try:
                link = Link(self.max_frame, self.on_nudge)
                try:
                    await self._open(link)
                    if self.tcp_address is not None:
                        await self._authenticate(link)
                    reply = await self.exchange(
                        link, {"cmd": "hello", "kwargs": hello}, self.request_timeout
                    )
                except ConnectionLost:  # it went away right after accepting: try again
                    link.close()
                    raise ConnectionResetError("the supervisor hung up during hello") from None
                except BaseException:
                    link.close()  # no task of its own ends it with the loop: close it here
                    raise
                break
            except OSError as exc:
                if loop.time() + delay > deadline:
                    raise SupervisorUnavailableError(
                        f"no supervisor at {self.socket_path} ({exc.strerror or exc}; the path"
                        f" is {self.source}): is `queryqueue supervisor` running there?"
                    ) from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)
        if was_connected:
            self.reconnects += 1
        if "error" in reply:
            raise_error(reply["error"])
        self.on_hello(link, reply["ok"])
        return link

    @property
    def tcp_address(self) -> tuple[str, int] | None:
        text = str(self.socket_path)
        if not text.startswith("tcp:/"):
            return None
        host, _, port = text.split("/")[-1].rpartition(":")
        return host, int(port)

    async def _open(self, link: Link) -> None:
        loop = asyncio.get_running_loop()
        address = self.tcp_address
        if address is None:
            transport, _ = await loop.create_unix_connection(
                lambda: link.reader, str(self.socket_path)
            )
            self.on_peer(peer_uid(transport.get_extra_info("socket")))
        else:
            await loop.create_connection(lambda: link.reader, *address)

    async def _authenticate(self, link: Link) -> None:
        if not self.auth_token:
            raise AuthenticationError(
                f"{self.socket_path} is a TCP listener: pass auth_token (its --auth-token-file)"
            )
        reply = await self.exchange(
            link, {"cmd": "auth", "args": [self.auth_token]}, self.request_timeout
        )
        if "error" in reply:
            link.close()
            raise_error(reply["error"])

    async def exchange(
        self, link: Link, message: dict[str, Any], answer_within: float | None
    ) -> dict[str, Any]:
        """Send `message` on `link` and await its reply (`ConnectionLost` if the link goes
        first, `CommandTimeoutError` past `answer_within` seconds)."""
        request_id = next(self.ids)
        future: asyncio.Future[dict[str, Any]] = link.loop.create_future()
        link.pending[request_id] = future
        if not link.alive:
            link.pending.pop(request_id, None)
            raise ConnectionLost()
        link.send(encode_frame({**message, "id": request_id}))
        if answer_within is not None:
            link.answer_within(request_id, answer_within)
        try:
            return await future
        except Overdue:
            raise CommandTimeoutError(
                f"{message.get('cmd') or 'command'}: no answer in {answer_within}s"
            ) from None
        except asyncio.CancelledError:
            # The caller gave up: its answer, or the link's loss, is nobody's to read.
            link.pending.pop(request_id, None)
            future.cancel()
            raise

    async def call(self, method: str, *args: Any, extra_wait: float = 0.0, **kwargs: Any) -> Any:
        """Send one command; returns the raw `ok` value."""
        message = {"cmd": method, "args": list(args), "kwargs": kwargs}
        retry = retry_safe(method, list(args), kwargs)
        while True:
            link = await self.connected()
            try:
                reply = await self.exchange(link, message, self.request_timeout + extra_wait)
            except ConnectionLost:
                if not retry:
                    raise SupervisorUnavailableError(
                        f"{method}: the supervisor went away before answering"
                    ) from None
                continue
            if "error" in reply:
                raise_error(reply["error"])
            return reply.get("ok")

    async def sql(self, text: str) -> list[dict[str, Any]]:
        link = await self.connected()
        try:
            reply = await self.exchange(link, {"sql": text}, self.request_timeout)
        except ConnectionLost:
            raise SupervisorUnavailableError("the supervisor went away before answering") from None
        if "error" in reply:
            raise_error(reply["error"])
        rows: list[dict[str, Any]] = reply.get("rows", [])
        return rows

    async def close(self) -> None:
        self.closed = True
        if self.link is not None and self._owner is not None and self._owner[0] == os.getpid():
            self.link.close()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self.link.reader.closed, _HANG_UP_S)
        self.link = None
