"""The client driver: the QUEUE commands sent to the supervisor over its socket.

Just another `QueueDriver`: the engine cannot tell it from a local store. One connection
per process and event loop, shared by every coroutine (requests are pipelined and matched
by id); a forked child or another loop opens its own, never reusing its parent's socket.
When the supervisor goes away the driver reconnects with bounded backoff. A command that
was sent but not answered is re-sent only when doing it twice is harmless (reads, ADD —
which deduplicates — and commands that name an item by its queue id, which is never
reused); otherwise the caller gets `SupervisorUnavailableError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import socket
import struct
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from queryqueue.driver_socket.deadlines import Deadlines
from queryqueue.driver_socket.frames import FrameReader
from queryqueue.driver_socket.paths import default_socket_path
from queryqueue.driver_socket.protocol import (
    DECODERS,
    DEFAULT_MAX_FRAME,
    FrameError,
    encode_frame,
    raise_error,
)
from queryqueue.driver_socket.segments import (
    DEFAULT_THRESHOLD,
    Reference,
    SegmentMaps,
    parse_reference,
    view_value,
)
from queryqueue.engine.aio import runs_here
from queryqueue.engine.binary import BinaryResult, Outcome, from_bytes
from queryqueue.engine.commands import served
from queryqueue.engine.errors import (
    AuthenticationError,
    CommandTimeoutError,
    ResultTooLargeError,
    StoreError,
    SupervisorUnavailableError,
)
from queryqueue.engine.responses import (
    AckResponse,
    AddAndRetrieveResponse,
    AddToQueueResponse,
    ListResponse,
    QueryDefResponse,
    QueueKey,
    ResultResponse,
    RetrieveResponse,
    ToCancelResponse,
)
from queryqueue.engine.retrieved import RetrievedQuery

_log = logging.getLogger("queryqueue.client")
# Room in a frame for an ACK's envelope around its result (id, command, key, quoting).
_FRAME_OVERHEAD = 4096
# How long closing a driver waits for its connection to end.
_HANG_UP_S = 5.0

COMMANDS = served()
# Supervisor commands (not the store's) that are safe to send twice.
_SUPERVISOR_SAFE = {"stats", "ping", "shm_release", "shm_view", "watch"}


class _Overdue(Exception):
    """A request's deadline passed unanswered."""


class _ConnectionLost(Exception):
    pass


def _retry_safe(method: str, args: list[Any], kwargs: dict[str, Any]) -> bool:
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


class _Link:
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
            future.set_exception(_Overdue())

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
                future.set_exception(_ConnectionLost())

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


def _peer_uid(sock: Any) -> int:
    """The uid of the process at the other end of a Unix socket (ours where the platform
    cannot say)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if sock is None or option is None:
        return os.geteuid()
    credentials = sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i"))
    return int(struct.unpack("3i", credentials)[1])


class SocketQueueDriver:
    def __init__(
        self,
        socket_path: str | Path | None = None,
        *,
        process_id: str | None = None,
        reconnect_timeout: float = 30.0,
        request_timeout: float = 60.0,
        max_frame: int = DEFAULT_MAX_FRAME,
        shm_threshold: int | None = DEFAULT_THRESHOLD,
        auth_token: str | None = None,
        decode_in_place: bool = False,
    ) -> None:
        """`socket_path` is a Unix socket's path, or `tcp://127.0.0.1:PORT` with the
        supervisor's `auth_token` (its --auth-token-file holds it).

        `shm_threshold`: results (ACKs) of at least this many bytes of JSON go through
        shared memory (None: never). Reading one works whatever this is.

        `decode_in_place`: a JSON result in shared memory is left to its reader as a
        binary one is (`ResultResponse.shared`), which parses it straight out of the
        segment: no text is made of it. A QueryQueue reads that way; by default `payload`
        is the result's text, as every driver's is."""
        self.shm_threshold = shm_threshold
        self.decode_in_place = decode_in_place
        self.auth_token = auth_token
        self._segments = SegmentMaps()
        self.socket_path = Path(socket_path) if socket_path is not None else default_socket_path()
        self.process_id = process_id
        self.reconnect_timeout = reconnect_timeout
        self.request_timeout = request_timeout
        self.max_frame = max_frame
        self._ids = itertools.count(1)
        self._link: _Link | None = None
        self._owner: tuple[int, asyncio.AbstractEventLoop] | None = None
        self._connecting: asyncio.Lock | None = None
        self.reconnects = 0
        self._closed = False
        # Prefixes the supervisor's worker pool runs (its hello says so on every connect).
        self.pool_prefixes: frozenset[str] = frozenset()
        self._slot_watchers: dict[str, set[Callable[[], None]]] = {}
        # RESULT_BLOCKINGs sent with their ADD (`then_wait_ms`), by (queue id, timeout),
        # until the caller asks for them: oldest first, since callers of this process that
        # joined one item (dedup) each sent one and each claims one.
        self._pipelined: dict[tuple[QueueKey, int], list[_Pipelined]] = {}

    # -- connection --------------------------------------------------------------------------

    def _forget_if_foreign(self) -> None:
        link = self._link
        if link is not None and runs_here(link.loop, link.thread):
            owner = (os.getpid(), link.loop)
        else:
            owner = (os.getpid(), asyncio.get_running_loop())
        if self._owner != owner:
            # A forked child or another loop: the old link belongs to someone else. Drop it
            # without touching it (closing could disturb the parent's connection).
            self._link = None
            self._connecting = asyncio.Lock()
            self._owner = owner

    async def _connected(self) -> _Link:
        if self._closed:
            raise SupervisorUnavailableError("this driver is closed")
        self._forget_if_foreign()
        link = self._link
        if link is not None and link.alive:
            return link
        assert self._connecting is not None
        async with self._connecting:
            if self._link is not None and self._link.alive:
                return self._link
            self._link = await self._connect()
            return self._link

    async def _connect(self) -> _Link:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.reconnect_timeout
        delay = 0.01
        was_connected = self._link is not None
        hello = {} if self.process_id is None else {"process_id": self.process_id}
        while True:
            try:
                link = _Link(self.max_frame, self._nudged)
                try:
                    await self._open(link)
                    if self.tcp_address is not None:
                        await self._authenticate(link)
                    reply = await self._exchange(
                        link, {"cmd": "hello", "kwargs": hello}, self.request_timeout
                    )
                except _ConnectionLost:  # it went away right after accepting: try again
                    link.close()
                    raise ConnectionResetError("the supervisor hung up during hello") from None
                except BaseException:
                    link.close()  # no task of its own ends it with the loop: close it here
                    raise
                break
            except OSError as exc:
                if loop.time() + delay > deadline:
                    raise SupervisorUnavailableError(
                        f"no supervisor at {self.socket_path} ({exc.strerror or exc})"
                    ) from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)
        if was_connected:
            self.reconnects += 1
        if "error" in reply:
            raise_error(reply["error"])
        self.pool_prefixes = frozenset(reply["ok"].get("pool", ()))
        for prefix in list(self._slot_watchers):  # a new connection: watch again
            link.send(encode_frame({"id": next(self._ids), "cmd": "watch", "args": [prefix]}))
        return link

    @property
    def tcp_address(self) -> tuple[str, int] | None:
        text = str(self.socket_path)
        if not text.startswith("tcp:/"):
            return None
        host, _, port = text.split("/")[-1].rpartition(":")
        return host, int(port)

    async def _open(self, link: _Link) -> None:
        loop = asyncio.get_running_loop()
        address = self.tcp_address
        if address is None:
            transport, _ = await loop.create_unix_connection(
                lambda: link.reader, str(self.socket_path)
            )
            # Segments are the supervisor's: whose it is, the kernel says of the socket.
            self._segments.owner = _peer_uid(transport.get_extra_info("socket"))
        else:
            await loop.create_connection(lambda: link.reader, *address)

    async def _authenticate(self, link: _Link) -> None:
        if not self.auth_token:
            raise AuthenticationError(
                f"{self.socket_path} is a TCP listener: pass auth_token (its --auth-token-file)"
            )
        reply = await self._exchange(
            link, {"cmd": "auth", "args": [self.auth_token]}, self.request_timeout
        )
        if "error" in reply:
            link.close()
            raise_error(reply["error"])

    async def _exchange(
        self, link: _Link, message: dict[str, Any], answer_within: float | None
    ) -> dict[str, Any]:
        request_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = link.loop.create_future()
        link.pending[request_id] = future
        if not link.alive:
            link.pending.pop(request_id, None)
            raise _ConnectionLost()
        link.send(encode_frame({**message, "id": request_id}))
        if answer_within is not None:
            link.answer_within(request_id, answer_within)
        try:
            return await future
        except _Overdue:
            raise CommandTimeoutError(
                f"{message.get('cmd') or 'command'}: no answer in {answer_within}s"
            ) from None
        except asyncio.CancelledError:
            # The caller gave up: its answer, or the link's loss, is nobody's to read.
            link.pending.pop(request_id, None)
            future.cancel()
            raise

    async def call(self, method: str, *args: Any, extra_wait: float = 0.0, **kwargs: Any) -> Any:
        """Send one command; returns the raw `ok` value (decode with DECODERS)."""
        message = {"cmd": method, "args": list(args), "kwargs": kwargs}
        retry = _retry_safe(method, list(args), kwargs)
        while True:
            link = await self._connected()
            try:
                reply = await self._exchange(link, message, self.request_timeout + extra_wait)
            except _ConnectionLost:
                if not retry:
                    raise SupervisorUnavailableError(
                        f"{method}: the supervisor went away before answering"
                    ) from None
                continue
            if "error" in reply:
                raise_error(reply["error"])
            return reply.get("ok")

    async def sql(self, text: str) -> list[dict[str, Any]]:
        """Run one QUEUE command given as Cube Store SQL text; returns Cube Store's rows."""
        link = await self._connected()
        try:
            reply = await self._exchange(link, {"sql": text}, self.request_timeout)
        except _ConnectionLost:
            raise SupervisorUnavailableError("the supervisor went away before answering") from None
        if "error" in reply:
            raise_error(reply["error"])
        rows: list[dict[str, Any]] = reply.get("rows", [])
        return rows

    async def watch_slots(self, prefix: str, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` when a slot of `prefix` may have freed (the supervisor's nudge
        after an ACK or CANCEL); returns the function that stops it."""
        watchers = self._slot_watchers.setdefault(prefix, set())
        first = not watchers
        watchers.add(callback)
        if first:
            await self.call("watch", prefix)

        def stop() -> None:
            watchers.discard(callback)

        return stop

    def _nudged(self, prefix: str) -> None:
        for callback in list(self._slot_watchers.get(prefix, ())):
            callback()

    async def hand_off(self, prefix: str, retrieved: RetrievedQuery) -> bool:
        """Give a retrieved query to the supervisor's pool, if it runs this prefix's."""
        if retrieved.persistent:  # a stream lives in the process that asked for it
            return False
        await self._connected()
        if prefix not in self.pool_prefixes:
            return False
        await self.dispatch(prefix, retrieved)
        return True

    async def dispatch(self, prefix: str, retrieved: RetrievedQuery) -> None:
        """Hand a retrieved query to the supervisor's worker pool; returns once accepted.

        Only the item's name travels: the supervisor reads the query from its own store
        (it must be active and not held yet), so a client cannot make a worker run anything
        but a queued query. Not re-sent after a lost answer: the item is active either
        way, and the stalled path reclaims it if the hand-off never arrived.
        """
        await self.call("dispatch", f"{prefix}:{retrieved.query_key_hash}", retrieved.queue_id)

    async def ping(self) -> str:
        """The supervisor's "pong": it is there and answering."""
        return str(await self.call("ping"))

    async def stats(self) -> dict[str, Any]:
        answer: dict[str, Any] = await self.call("stats")
        return answer

    async def close(self) -> None:
        self._closed = True
        if self._link is not None and self._owner is not None and self._owner[0] == os.getpid():
            self._link.close()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self._link.reader.closed, _HANG_UP_S)
        self._link = None
        self._segments.close()

    # -- the QUEUE commands ------------------------------------------------------------------------

    async def _decoded(
        self, method: str, *args: Any, extra_wait: float = 0.0, **kwargs: Any
    ) -> Any:
        return DECODERS[method](await self.call(method, *args, extra_wait=extra_wait, **kwargs))

    async def add(
        self,
        path: str,
        payload: str,
        *,
        priority: int = 0,
        orphaned: float | None = None,
        external_id: str | None = None,
        exclusive: bool = False,
        process_id: str | None = None,
        if_no_result: bool = False,
        then_wait_ms: int | None = None,
    ) -> AddToQueueResponse:
        options = _add_options(priority, orphaned, external_id, exclusive, process_id, if_no_result)
        answer: AddToQueueResponse = await self._adding(
            "add", [path, payload], options, then_wait_ms
        )
        return answer

    async def add_and_retrieve(
        self,
        path: str,
        payload: str,
        concurrency: int,
        *,
        priority: int = 0,
        orphaned: float | None = None,
        external_id: str | None = None,
        exclusive: bool = False,
        process_id: str | None = None,
        if_no_result: bool = False,
        then_wait_ms: int | None = None,
        list_active: bool = True,
    ) -> AddAndRetrieveResponse:
        await self._connected()  # its hello says which prefixes the pool runs
        # The supervisor hands what it retrieves to its pool itself: no hand-off round trip.
        dispatch = not exclusive and path.rpartition(":")[0] in self.pool_prefixes
        options = _add_options(priority, orphaned, external_id, exclusive, process_id, if_no_result)
        answer: AddAndRetrieveResponse = await self._adding(
            "add_and_retrieve",
            [path, payload, concurrency],
            {
                **({"dispatch": True} if dispatch else {}),
                **options,
                **({} if list_active else {"list_active": False}),  # Cube's knows nothing of it
            },
            then_wait_ms,
        )
        return answer

    async def _adding(
        self, method: str, args: list[Any], kwargs: dict[str, Any], then_wait_ms: int | None
    ) -> Any:
        """ADD (or ADD_AND_RETRIEVE), with the RESULT_BLOCKING of the answered id that the
        caller makes next sent in the same frame (`then_wait`): the supervisor runs both in
        one batch, and `result_blocking` answers from it. Lost with its connection, the
        ADD is sent again the ordinary way (and the long poll then is too)."""
        if then_wait_ms is None or then_wait_ms < 0:
            return await self._decoded(method, *args, **kwargs)
        link = await self._connected()
        wait_id = next(self._ids)
        waited: asyncio.Future[dict[str, Any]] = link.loop.create_future()
        link.pending[wait_id] = waited
        pipelined = _Pipelined(link, wait_id, waited)
        message = {
            "cmd": method,
            "args": args,
            "kwargs": {**kwargs, "then_wait": [wait_id, then_wait_ms]},
        }
        try:
            reply = await self._exchange(link, message, self.request_timeout)
        except _ConnectionLost:
            pipelined.drop()
            return await self._decoded(method, *args, **kwargs)
        except BaseException:
            pipelined.drop()
            raise
        if "error" in reply:
            pipelined.drop()
            raise_error(reply["error"])
        answer = DECODERS[method](reply.get("ok"))
        self._keep_pipelined((answer.id, then_wait_ms), pipelined)
        return answer

    def _keep_pipelined(self, key: tuple[QueueKey, int], pipelined: _Pipelined) -> None:
        self._pipelined.setdefault(key, []).append(pipelined)

        def forget() -> None:  # answered and never asked for: nobody will
            kept = self._pipelined.get(key, [])
            if pipelined in kept:
                kept.remove(pipelined)
                if not kept:
                    del self._pipelined[key]
                pipelined.drop()

        def kept(waited: asyncio.Future[dict[str, Any]]) -> None:
            if not waited.cancelled():
                # Its connection's loss is nobody's concern until the poll is claimed (the
                # claim still sees it): no "exception was never retrieved" at collection.
                waited.exception()
            if pipelined in self._pipelined.get(key, ()):  # claimed already: no timer
                asyncio.get_running_loop().call_later(_PIPELINED_KEPT_S, forget)

        pipelined.waited.add_done_callback(kept)

    def _claim_pipelined(self, key: tuple[QueueKey, int]) -> _Pipelined | None:
        kept = self._pipelined.get(key)
        if not kept:
            return None
        pipelined = kept.pop(0)
        if not kept:
            del self._pipelined[key]
        return pipelined

    async def retrieve(
        self,
        key: QueueKey,
        *,
        concurrency: int = 1,
        extended: bool = True,
        process_id: str | None = None,
    ) -> RetrieveResponse | None:
        answer: RetrieveResponse | None = await self._decoded(
            "retrieve", key, concurrency=concurrency, extended=extended, process_id=process_id
        )
        return answer

    async def ack(self, key: QueueKey, result: Outcome | None) -> AckResponse:
        if (
            isinstance(result, str)
            and self.shm_threshold is not None
            and len(result) >= self.shm_threshold
        ):
            result = from_bytes("json", result.encode())
        if isinstance(result, BinaryResult):
            result = await self._share(result)
        if result is not None and len(result) + _FRAME_OVERHEAD > self.max_frame:
            raise ResultTooLargeError(
                f"a result of {len(result)} bytes is over the socket's frame limit of "
                f"{self.max_frame} bytes, and shared memory could not take it"
            )
        answer: AckResponse = await self._decoded("ack", key, result)
        return answer

    async def _share(self, result: BinaryResult) -> str:
        """The reference to ACK with, once `result` is written (once, in place) into a
        segment; its inline text where shared memory is off, the result small, or no
        segment has room for it (a full /dev/shm, a cap): the socket way."""
        if self.shm_threshold is None or result.size < self.shm_threshold:
            return result.inline_text()
        try:
            slot = await self.call("shm_alloc", result.size)
            return self._segments.write_binary(slot, result)
        except StoreError as exc:
            _log.warning("result of %d bytes goes through the socket: %s", result.size, exc)
            return result.inline_text()

    async def _read_shared(self, answer: ResultResponse | None) -> ResultResponse | None:
        """Copy a shared-memory result out of its segment, then release our lease; a
        binary one is left to its reader (`_SharedRead`), which may view it in place."""
        ref = parse_reference(answer.payload) if answer is not None else None
        if answer is None or ref is None:
            return answer
        if ref.form != "json" or self.decode_in_place:
            return dataclasses.replace(answer, shared=_SharedRead(self, ref))
        try:
            payload = self._segments.read(ref)
        finally:
            with contextlib.suppress(SupervisorUnavailableError):
                await self.call("shm_release", ref[0], ref[1])
        return dataclasses.replace(answer, payload=payload)

    async def result(
        self, key: QueueKey, *, external_id: str | None = None, consumer: str | None = None
    ) -> ResultResponse | None:
        if isinstance(key, str) and consumer is None:
            # A read by path consumes the result: name it, so that re-sending it after a
            # lost answer gets the same result instead of nothing.
            consumer = uuid.uuid4().hex
        answer: ResultResponse | None = await self._decoded(
            "result", key, external_id=external_id, consumer=consumer
        )
        return await self._read_shared(answer)

    async def result_blocking(self, key: QueueKey, timeout_ms: int) -> ResultResponse | None:
        extra = timeout_ms / 1000 if isinstance(timeout_ms, int) and timeout_ms > 0 else 0.0
        pipelined = self._claim_pipelined((key, timeout_ms))
        reply = None if pipelined is None else await pipelined.reply(self.request_timeout + extra)
        if reply is not None:
            if "error" in reply:
                raise_error(reply["error"])
            answer: ResultResponse | None = DECODERS["result_blocking"](reply.get("ok"))
        else:
            answer = await self._decoded("result_blocking", key, timeout_ms, extra_wait=extra)
        return await self._read_shared(answer)

    async def get(self, key: QueueKey) -> QueryDefResponse | None:
        answer: QueryDefResponse | None = await self._decoded("get", key)
        return answer

    async def cancel(self, key: QueueKey, *, result: str | None = None) -> QueryDefResponse | None:
        answer: QueryDefResponse | None
        if result is None:  # Cube's CANCEL, as any Cube client sends it
            answer = await self._decoded("cancel", key)
        else:
            answer = await self._decoded("cancel", key, result=result)
        return answer

    async def heartbeat(self, key: QueueKey) -> bool:
        return bool(await self.call("heartbeat", key))

    async def merge_extra(self, key: QueueKey, extra: str) -> bool:
        return bool(await self.call("merge_extra", key, extra))

    async def list_items(
        self, prefix: str, *, with_payload: bool = False, process_id: str | None = None
    ) -> list[ListResponse]:
        answer: list[ListResponse] = await self._decoded(
            "list_items", prefix, with_payload=with_payload, process_id=process_id
        )
        return answer

    async def pending(
        self,
        prefix: str,
        *,
        with_payload: bool = False,
        process_id: str | None = None,
        limit: int | None = None,
    ) -> list[ListResponse]:
        answer: list[ListResponse] = await self._decoded(
            "pending", prefix, with_payload=with_payload, process_id=process_id, limit=limit
        )
        return answer

    async def active(
        self, prefix: str, *, with_payload: bool = False, process_id: str | None = None
    ) -> list[ListResponse]:
        answer: list[ListResponse] = await self._decoded(
            "active", prefix, with_payload=with_payload, process_id=process_id
        )
        return answer

    async def to_cancel(
        self, heartbeat_timeout_ms: int | None, orphaned_timeout_ms: int | None, prefix: str
    ) -> list[ToCancelResponse]:
        answer: list[ToCancelResponse] = await self._decoded(
            "to_cancel", heartbeat_timeout_ms, orphaned_timeout_ms, prefix
        )
        return answer

    async def truncate(self) -> None:
        await self.call("truncate")


def _add_options(
    priority: int,
    orphaned: float | None,
    external_id: str | None,
    exclusive: bool,
    process_id: str | None,
    if_no_result: bool,
) -> dict[str, Any]:
    """ADD's keyword arguments as they travel (`if_no_result` only when set: a Cube
    client's supervisor knows nothing of it)."""
    return {
        "priority": priority,
        "orphaned": orphaned,
        "external_id": external_id,
        "exclusive": exclusive,
        "process_id": process_id,
        **({"if_no_result": True} if if_no_result else {}),
    }


_PIPELINED_KEPT_S = 5.0  # an answered, unclaimed pipelined long poll is dropped after


@dataclasses.dataclass(eq=False)
class _Pipelined:
    """A RESULT_BLOCKING sent with its ADD: its answer, when it comes, on `link`."""

    link: _Link
    wait_id: int
    waited: asyncio.Future[dict[str, Any]]

    async def reply(self, within: float) -> dict[str, Any] | None:
        """Its reply; None if its connection was lost (ask again, the ordinary way)."""
        if not self.waited.done():
            self.link.answer_within(self.wait_id, within)
        try:
            return await self.waited
        except _ConnectionLost:
            return None
        except _Overdue:
            self.drop()
            raise CommandTimeoutError(f"result_blocking: no answer in {within}s") from None
        except asyncio.CancelledError:
            self.drop()
            raise

    def drop(self) -> None:
        self.link.pending.pop(self.wait_id, None)
        if self.waited.done():
            if not self.waited.cancelled():
                self.waited.exception()  # retrieved: no "never retrieved" warning
        else:
            self.waited.cancel()


@dataclasses.dataclass(eq=False)
class _SharedRead:
    """A binary result in shared memory, leased to this connection until it is read: a
    copy releases the lease at once, a view when its `release` is called."""

    driver: SocketQueueDriver
    ref: Reference

    async def read(self, *, view: bool) -> dict[str, Any]:
        ref, driver = self.ref, self.driver
        if ref.form == "json":  # a copy whatever `view` says: its values are Python's
            try:
                outcome: dict[str, Any] = driver._segments.read_json(ref)
            finally:
                await self.release()
            return outcome
        if not view:
            try:
                value = driver._segments.read_value(ref)
            finally:
                await self.release()
            return {"result": value}
        try:
            await driver.call("shm_view", ref.name, ref.generation)
            value, memory = view_value(ref, driver._segments.owner)
        except BaseException:
            await self.release()
            raise

        async def release_view() -> None:
            # Unmapped only if nothing views it any more; else the supervisor never
            # rewrites the segment (a view used after its release still reads its result).
            try:
                memory.close()
            except BufferError:
                await self.release(view_closed=False)
            else:
                await self.release(view_closed=True)

        return {"result": value, "$lease": release_view}

    async def release(self, view_closed: bool | None = None) -> None:
        args = [self.ref.name, self.ref.generation]
        if view_closed is not None:
            args.append(view_closed)
        with contextlib.suppress(SupervisorUnavailableError):
            await self.driver.call("shm_release", *args)
