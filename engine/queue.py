"""QueryQueue, Cube's design in asyncio: its face, the reconcile and the lifecycle.
The request side is `requests.py`, the background side `executor.py`, `get_queries` and
`get_query_stage` `introspection.py`.

It never holds queue state: every transition is a QUEUE command through the driver, so
any number of QueryQueue objects in any number of processes share one queue.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from queryqueue.engine import events as ev
from queryqueue.engine import introspection
from queryqueue.engine import validation as v
from queryqueue.engine.aio import wait_within
from queryqueue.engine.clock import Clock, SystemClock
from queryqueue.engine.codec import Codecs
from queryqueue.engine.connection import QueryDef, QueueConnection
from queryqueue.engine.driver import LocalQueueDriver, QueueDriver
from queryqueue.engine.errors import (
    ContinueWaitError,
    InvalidCommandError,
    QueryTimeoutError,
)
from queryqueue.engine.events import EventLogger, Events
from queryqueue.engine.executor import Executor
from queryqueue.engine.handlers import (
    CancelHandler,
    Handler,
    SendProcessMessage,
    StreamHandler,
    as_query_handler,
)
from queryqueue.engine.hashing import hash_query_key, js_number
from queryqueue.engine.outcome import encode_cancelled
from queryqueue.engine.reconcile import Reconciler, process_query
from queryqueue.engine.requests import Request, RequestSide
from queryqueue.engine.responses import QueueId
from queryqueue.engine.retrieved import RetrievedQuery
from queryqueue.engine.retrying import HandlerPolicy
from queryqueue.engine.store import QueueStore
from queryqueue.engine.stream import QueryStream, Streams

SendCancelMessage = Callable[[QueryDef, QueueId | None], Awaitable[None]]


# How long past a caller's timeout `run` waits before it gives up on a wait that did not
# end by itself: a long poll ends at the timeout on its server's side, and one cut short
# here would stay parked there and take the result its caller no longer reads.
BOUND_SLACK_S = 1.0


DEFAULT_CONCURRENCY = 2  # queries of a queue running at once, everywhere


class QueryQueue:
    """Cube's QueryQueue: identical queries in flight run once, at most `concurrency` at
    once, in priority order, with callers long-polling for the result (`run`)."""

    # Set by a supervisor's pool: the ids it holds for live workers (never stalled), and
    # how many more its workers can start now (all its reconcile retrieves).
    held_here: Callable[[QueueId], bool] | None = None
    room_here: Callable[[], int] | None = None

    def __init__(
        self,
        prefix: str,
        *,
        query_handlers: Mapping[str, Handler],
        cancel_handlers: Mapping[str, CancelHandler] | None = None,
        stream_handler: StreamHandler | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
        continue_wait_timeout: float = 5.0,
        execution_timeout: float = 600.0,
        orphaned_timeout: float = 120.0,
        heartbeat_interval: float = 30.0,
        process_uid: str | None = None,
        send_process_message_fn: SendProcessMessage | None = None,
        send_cancel_message_fn: SendCancelMessage | None = None,
        logger: EventLogger | None = None,
        driver: QueueDriver | QueueStore | None = None,
        clock: Clock | None = None,
        fast_track: bool = True,
        reconcile: bool = True,
        codecs: Codecs | None = None,
        handler_policies: Mapping[str, HandlerPolicy] | None = None,
    ) -> None:
        v.check_queue_options(
            concurrency=concurrency,
            continue_wait_timeout=continue_wait_timeout,
            execution_timeout=execution_timeout,
            orphaned_timeout=orphaned_timeout,
            heartbeat_interval=heartbeat_interval,
        )
        self.prefix = prefix
        self.query_handlers = {
            name: as_query_handler(name, handler) for name, handler in query_handlers.items()
        }
        self.cancel_handlers = dict(cancel_handlers or {})
        self.stream_handler = stream_handler
        self.concurrency = concurrency
        self.continue_wait_timeout = continue_wait_timeout
        self.execution_timeout = execution_timeout
        self.orphaned_timeout, self.heartbeat_interval = orphaned_timeout, heartbeat_interval
        self.process_uid = process_uid or str(uuid.uuid4())
        self.fast_track = fast_track
        self.reconcile = reconcile  # False: a supervisor reconciles for it (its own streams aside)
        self.clock: Clock = clock or SystemClock()
        self.codecs = codecs or Codecs()  # results' types, both ways
        self.handler_policies = dict(handler_policies or {})  # by handler: retries, timeout
        self.events = Events(logger)
        self.driver: QueueDriver = (
            LocalQueueDriver(driver) if driver is None or isinstance(driver, QueueStore) else driver
        )
        self.connection = self._connection()
        self.send_process_message_fn = send_process_message_fn or self._execute_in_background
        self.send_cancel_message_fn = send_cancel_message_fn or self._cancel_in_background
        self.streams = Streams()
        self.closing = self._closed = False
        self.reconciler = Reconciler(self)
        self._background: set[asyncio.Task[Any]] = set()
        # closing: shutdown() in progress, start nothing new; _closed: close() was called.
        self.executor = Executor(self)
        self.requests = RequestSide(self)

    def _connection(self) -> QueueConnection:
        """Cube's driver methods, bound to this queue's prefix and timeouts."""
        return QueueConnection(
            self.driver,
            self.prefix,
            process_uid=self.process_uid,
            concurrency=self.concurrency,
            continue_wait_timeout=self.continue_wait_timeout,
            orphaned_timeout=self.orphaned_timeout,
            heartbeat_timeout=self.heartbeat_interval * 4,
        )

    # -- request side --------------------------------------------------------------------

    def hash_query_key(self, query_key: Any, *, persistent: bool = False) -> str:
        """The key's hash as this queue stores it (Cube's, with `@processUid` if persistent).
        A key of typed values (a date, a Decimal) is hashed as its codec's JSON."""
        try:
            return hash_query_key(query_key, persistent=persistent, process_uid=self.process_uid)
        except (TypeError, InvalidCommandError):  # not JSON as it is: its codec's JSON
            return hash_query_key(
                self.plain_key(query_key), persistent=persistent, process_uid=self.process_uid
            )

    def plain_key(self, query_key: Any) -> Any:
        """The key as JSON: itself if it is JSON, else its codec's JSON and the types it
        holds (`InvalidCommandError` for a value without a codec)."""
        plain, types = self.codecs.encode_value(query_key, "query key")
        return plain if types is None else [plain, types]

    async def execute_in_queue(
        self,
        query_handler: str,
        query_key: Any,
        query: Any,
        priority: int = 0,
        *,
        stage_query_key: Any = None,
        request_id: str | None = None,
        span_id: str | None = None,
    ) -> Any:
        """Enqueue (or join) a query and wait up to `continue_wait_timeout` for its result.

        Cube's call: raises `ContinueWaitError` when the wait ends first (call again: the
        retry finds the result or the same item), `QueryError` (or its family:
        `QueryCancelledError`, `QueryTimeoutError`) when it failed. `run()` does the
        retrying for you.
        """
        return await self.requests.execute(
            Request(
                query_handler, query_key, query, priority, stage_query_key, request_id, span_id
            ),
            self.continue_wait_timeout,
        )

    async def run(
        self,
        query_handler: str,
        query_key: Any,
        query: Any,
        *,
        priority: int = 0,
        timeout: float | None = None,  # noqa: ASYNC109 - the caller's deadline, like Future.result(timeout)
        request_id: str | None = None,
        stage_query_key: Any = None,
        view: bool = False,
        execution_timeout: float | None = None,
        max_age: float | None = None,
    ) -> Any:
        """Enqueue (or join) a query and wait for its result, however long it takes.

        Re-polls the same item while it runs; raises `QueryTimeoutError` once `timeout`
        seconds have passed without a result (the query itself goes on, for other callers),
        `QueryCancelledError` if cancelled, `QueryError` if its handler failed. `view`:
        answer a `ResultView` (a binary result read in place until released).
        `execution_timeout`: seconds its execution may take, where shorter than its
        handler's and queue's (set by the call that enqueues it, not one that joins it).
        `max_age`: a stored result of the query younger than that many seconds answers,
        read before or not (None: its handler policy's, if any; else only an unread one)."""
        if timeout is not None and not timeout > 0:
            raise InvalidCommandError(f"timeout must be positive seconds, got {timeout!r}")
        if max_age is None and (policy := self.handler_policies.get(query_handler)):
            max_age = policy.max_age
        request = Request(
            query_handler, query_key, query, priority, stage_query_key, request_id, None, view,
            execution_timeout, max_age,
        )  # fmt: skip
        # The loop's clock bounds every wait too, reconnecting to a driver's server included.
        bound = asyncio.timeout(None if timeout is None else timeout + BOUND_SLACK_S)
        try:
            async with bound:
                return await self._poll(request, within=timeout)
        except TimeoutError:
            if not bound.expired():
                raise
            raise QueryTimeoutError(
                f"no result for the query within {js_number(timeout or 0)} s"
            ) from None

    async def _poll(self, request: Request, *, within: float | None) -> Any:
        """`run`'s long polls of one item, for `within` seconds of the queue's clock."""
        view = request.view
        deadline = None if within is None else self.clock.now_ms() + round(within * 1000)
        queue_id: QueueId | None = None
        while True:
            wait = self.continue_wait_timeout
            if deadline is not None:
                remaining = (deadline - self.clock.now_ms()) / 1000
                if remaining <= 0:
                    raise QueryTimeoutError(
                        f"no result for the query within {js_number(within or 0)} s"
                    )
                wait = min(wait, remaining)
            try:
                if queue_id is not None:
                    # A result by queue id reads many times: another caller's read by path
                    # cannot have taken it from us. It may be a retry outcome (its worker
                    # died between two polls): a continue-wait like a poll's.
                    found = await self.connection.get_result_by_id(queue_id, view=view)
                    if found is not None:
                        return self.requests.answer(found, view)
                return await self.requests.execute(request, wait)
            except ContinueWaitError as exc:
                # None after a retry outcome: that item is gone, the next poll enqueues anew.
                queue_id = exc.queue_id

    # -- reconcile -------------------------------------------------------------------------

    async def reconcile_queue(self) -> None:
        """Single-flight: callers during a run share it and cause exactly one more run."""
        if not (self.closing or self._closed):
            await self.reconciler.run()

    # -- background side ----------------------------------------------------------------------

    async def process_query(self, query_key_hash: str, queue_id: QueueId | None = None) -> None:
        """Retrieve the item and hand it off. Never executes it: the hand-off returns first."""
        await process_query(self, query_key_hash, queue_id)

    async def execute_query(self, retrieved: RetrievedQuery) -> bool:
        """Run a retrieved item to its ACK, then reconcile (`Executor.execute_query`)."""
        return await self.executor.execute_query(retrieved)

    async def process_cancel(self, query_def: QueryDef, queue_id: QueueId | None) -> None:
        """Call the cancel handler of the query's handler, and stop the query if it runs in
        this process."""
        await self.executor.process_cancel(query_def, queue_id)

    def cancel_execution(self, queue_id: QueueId) -> bool:
        """Stop an execution of this process whose item was removed elsewhere (see
        `Executor.cancel_execution`)."""
        return self.executor.cancel_execution(queue_id)

    @property
    def handler_threads(self) -> int:
        """Sync handlers still running in threads (see `Executor.handler_threads`)."""
        return self.executor.handler_threads

    def wait_for_handler_threads(self, timeout: float | None = None) -> bool:
        """Block until no sync handler of this queue runs on a thread; False on timeout."""
        return self.executor.wait_for_handler_threads(timeout)

    async def _execute_in_background(self, retrieved: RetrievedQuery) -> None:
        # A supervisor with a pool for this prefix runs it there: a web process asking at
        # priority 10 (the fast track retrieves in the asking process) runs nothing itself.
        if await self.driver.hand_off(self.prefix, retrieved):
            return
        self._spawn(self.execute_query(retrieved))

    async def _cancel_in_background(self, query_def: QueryDef, queue_id: QueueId | None) -> None:
        self._spawn(self.process_cancel(query_def, queue_id))

    def _spawn(self, coroutine: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # -- cancellation and introspection ---------------------------------------------------------

    async def cancel_query(self, query_key_hash: str, queue_id: QueueId | None = None) -> bool:
        """Cancel a queued or running query: its waiters get `QueryCancelledError`, the
        execution is stopped and its cancel handler called. False if nothing was cancelled."""
        query_def = await self.connection.cancel_query(query_key_hash, queue_id, encode_cancelled())
        if queue_id is None:
            # Cancelled by key: if it runs here, name the execution so it is stopped now.
            queue_id = self.executor.running(query_key_hash)
        if query_def is not None:
            self.events.emit(
                ev.CANCELLING_MANUAL,
                {
                    "queueId": queue_id,
                    "queryKey": query_def.get("queryKey"),
                    "queuePrefix": self.prefix,
                    "requestId": query_def.get("requestId"),
                },
            )
            await self.send_cancel_message_fn(query_def, queue_id)
        return query_def is not None

    async def cancel_query_by_request_id(self, request_id: str) -> list[QueryDef]:
        """Cancel every query asked with `request_id`; their definitions."""
        cancelled = []
        for entry in await self.get_queries():
            if entry.get("requestId") == request_id:
                await self.cancel_query(entry["queryKeyHash"], entry.get("queueId"))
                cancelled.append(entry)
        return cancelled

    async def get_queries(self) -> list[QueryDef]:
        """Every item of the queue with its statuses: orphaned, stalled, active, toProcess
        (Cube's entries: `queryKey` is the hash)."""
        return await introspection.get_queries(self)

    async def fetch_query_stage_state(self) -> tuple[list[str], list[str], dict[str, QueryDef]]:
        """Cube's stage state: active hashes, pending hashes, definitions by hash."""
        return await self.connection.get_query_stage_state(False)

    async def get_query_stage(
        self,
        stage_query_key: Any,
        priority_filter: int | None = None,
        stage_state: tuple[list[str], list[str], dict[str, QueryDef]] | None = None,
    ) -> dict[str, Any] | None:
        """`{"stage": "Executing query", "timeElapsed": ms}`, `{"stage": "#N in queue"}` or None."""
        return await introspection.get_query_stage(
            self, stage_query_key, priority_filter, stage_state
        )

    # -- streams --------------------------------------------------------------------------------

    def get_query_stream(self, query_key_hash: str) -> QueryStream | None:
        """The stream of a stream query running in this process, by its key's hash."""
        return self.streams.get(query_key_hash)

    async def _wait_for_stream(
        self, query_key_hash: str, waiter: asyncio.Future[QueryStream]
    ) -> QueryStream:
        # The map covers a stream that started before this waiter existed (a joined caller).
        stream = self.streams.get(query_key_hash)
        if stream is not None:
            return stream

        # Only this process may retrieve its stream item, and other processes' ACKs do not
        # reconcile for it: look again whenever a slot frees, and every long-poll period.
        def nudged() -> None:
            self._spawn(self.reconcile_queue())

        stop_watching = await self.driver.watch_slots(self.prefix, nudged)
        try:
            # Watch, then look: a slot freed before the watch was in place is not missed.
            await self.reconcile_queue()
            for _ in range(10):
                try:
                    return await wait_within(waiter, self.continue_wait_timeout)
                except TimeoutError:
                    await self.reconcile_queue()
        finally:
            stop_watching()
        raise ContinueWaitError()

    # -- lifecycle ----------------------------------------------------------------------------

    async def shutdown(self, grace: float = 30.0) -> bool:
        """Wait for a reconcile in flight, give the executions running here up to `grace`
        seconds to finish and ACK, then stop the rest (their items are reclaimed through
        the stalled path). Returns whether a reconcile was in flight.

        As in Cube, the queue stays usable: later calls enqueue and reconcile as before.
        `close()` ends it for good."""
        self.closing = True
        try:
            in_flight = await self.reconciler.finish()
            if self._background and grace > 0:
                # Executions may be running other processes' queries: cutting them off
                # would make those run twice once reclaimed.
                await asyncio.wait(list(self._background), timeout=grace)
            await self._stop_background()
        finally:
            self.closing = False
        return in_flight

    async def close(self, grace: float = 30.0) -> None:
        """Shut down, and refuse new work from now on with `QueueClosedError`."""
        self._closed = True
        await self.shutdown(grace)
        self.executor.close()  # its idle handler threads end

    async def _stop_background(self) -> None:
        while self.reconciler.running or self._background:
            await self.reconciler.finish()
            for task in list(self._background):
                task.cancel()
            await asyncio.gather(*self._background, return_exceptions=True)
        handlers = [
            e.handler_task for e in self.executor.executions.values() if e.handler_task is not None
        ]
        for handler in handlers:
            handler.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
