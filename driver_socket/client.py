"""The socket driver: the QUEUE commands sent to the supervisor over its socket.

Just another `QueueDriver`: the engine cannot tell it from a local store. Its connection
(`link.py`) is shared by every coroutine of the process and event loop and reconnects
with bounded backoff; large results come and go through shared memory (`segments.py`,
`reads.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from queryqueue.driver_socket.link import Connection, ConnectionLost, Link
from queryqueue.driver_socket.paths import default_socket_path, socket_source
from queryqueue.driver_socket.permits import PollPermits
from queryqueue.driver_socket.protocol import (
    DECODERS,
    DEFAULT_MAX_FRAME,
    encode_frame,
    raise_error,
)
from queryqueue.driver_socket.reads import PipelinedPoll, PipelinedPolls, SharedRead
from queryqueue.driver_socket.segments import (
    DEFAULT_THRESHOLD,
    SegmentMaps,
    parse_reference,
)
from queryqueue.engine.binary import BinaryResult, Outcome, from_bytes
from queryqueue.engine.commands import served
from queryqueue.engine.errors import (
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


class SocketQueueDriver:
    """The QUEUE commands through a supervisor's socket (or its TCP port, with the token):
    reconnects by itself, long polls on their own connection, large results in place."""

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
        source = "the one given" if socket_path is not None else socket_source()
        self.process_id = process_id
        self.reconnect_timeout = reconnect_timeout
        self.request_timeout = request_timeout
        self.max_frame = max_frame
        self.connection = Connection(
            self.socket_path,
            process_id=process_id,
            reconnect_timeout=reconnect_timeout,
            request_timeout=request_timeout,
            max_frame=max_frame,
            auth_token=auth_token,
            on_hello=self._hello,
            on_nudge=self._nudged,
            on_peer=self._supervisor_is,
            source=source,
        )
        # Prefixes the supervisor's worker pool runs (its hello says so on every connect).
        self.pool_prefixes: frozenset[str] = frozenset()
        self._slot_watchers: dict[str, set[Callable[[], None]]] = {}
        self.pipelined = PipelinedPolls()
        self.polls = PollPermits()  # long polls at the supervisor at once: its limit

    @property
    def reconnects(self) -> int:
        """How often this driver connected again after losing its connection."""
        return int(self.connection.reconnects)

    async def call(self, method: str, *args: Any, extra_wait: float = 0.0, **kwargs: Any) -> Any:
        """Send one command; returns the raw `ok` value (decode with DECODERS)."""
        return await self.connection.call(method, *args, extra_wait=extra_wait, **kwargs)

    async def sql(self, text: str) -> list[dict[str, Any]]:
        """Run one QUEUE command given as Cube Store SQL text; returns Cube Store's rows."""
        return await self.connection.sql(text)

    def _hello(self, link: Link, hello: dict[str, Any]) -> None:
        # Prefixes the supervisor's worker pool runs; a new connection watches again.
        self.pool_prefixes = frozenset(hello.get("pool", ()))
        limit = hello.get("max_long_polls")
        if isinstance(limit, int):
            self.polls.set_limit(limit)
        for prefix in list(self._slot_watchers):
            link.send(
                encode_frame({"id": next(self.connection.ids), "cmd": "watch", "args": [prefix]})
            )

    def _supervisor_is(self, uid: int) -> None:
        self._segments.owner = uid  # segments are the supervisor's: the socket's peer

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
        await self.connection.connected()
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
        await self.connection.close()
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
        max_age_ms: int | None = None,
        then_wait_ms: int | None = None,
    ) -> AddToQueueResponse:
        options = _add_options(
            priority, orphaned, external_id, exclusive, process_id, if_no_result, max_age_ms
        )
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
        max_age_ms: int | None = None,
        then_wait_ms: int | None = None,
        list_active: bool = True,
    ) -> AddAndRetrieveResponse:
        await self.connection.connected()  # its hello says which prefixes the pool runs
        # The supervisor hands what it retrieves to its pool itself: no hand-off round trip.
        dispatch = not exclusive and path.rpartition(":")[0] in self.pool_prefixes
        options = _add_options(
            priority, orphaned, external_id, exclusive, process_id, if_no_result, max_age_ms
        )
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
        link = await self.connection.connected()
        if not self.polls.try_take():  # its long poll waits for a permit, sent later
            return await self._decoded(method, *args, **kwargs)
        wait_id = next(self.connection.ids)
        waited: asyncio.Future[dict[str, Any]] = link.loop.create_future()
        waited.add_done_callback(lambda _: self.polls.give())
        link.pending[wait_id] = waited
        pipelined = PipelinedPoll(link, wait_id, waited)
        message = {
            "cmd": method,
            "args": args,
            "kwargs": {**kwargs, "then_wait": [wait_id, then_wait_ms]},
        }
        try:
            reply = await self.connection.exchange(link, message, self.request_timeout)
        except ConnectionLost:
            pipelined.drop()
            return await self._decoded(method, *args, **kwargs)
        except BaseException:
            pipelined.drop()
            raise
        if "error" in reply:
            pipelined.drop()
            raise_error(reply["error"])
        answer = DECODERS[method](reply.get("ok"))
        self.pipelined.keep((answer.id, then_wait_ms), pipelined)
        return answer

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
        binary one is left to its reader (`SharedRead`), which may view it in place."""
        ref = parse_reference(answer.payload) if answer is not None else None
        if answer is None or ref is None:
            return answer
        if ref.form != "json" or self.decode_in_place:
            return dataclasses.replace(answer, shared=SharedRead(self, ref))
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
        pipelined = self.pipelined.claim((key, timeout_ms))
        reply = None if pipelined is None else await pipelined.reply(self.request_timeout + extra)
        if reply is not None:
            if "error" in reply:
                raise_error(reply["error"])
            answer: ResultResponse | None = DECODERS["result_blocking"](reply.get("ok"))
        else:
            await self.polls.take()
            try:
                answer = await self._decoded("result_blocking", key, timeout_ms, extra_wait=extra)
            finally:
                self.polls.give()
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
    max_age_ms: int | None,
) -> dict[str, Any]:
    """ADD's keyword arguments as they travel (`if_no_result` and `max_age_ms` only when
    set: a Cube client's supervisor knows nothing of them)."""
    return {
        "priority": priority,
        "orphaned": orphaned,
        "external_id": external_id,
        "exclusive": exclusive,
        "process_id": process_id,
        **({"if_no_result": True} if if_no_result else {}),
        **({"max_age_ms": max_age_ms} if max_age_ms is not None else {}),
    }
