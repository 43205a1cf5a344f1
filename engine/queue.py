"""QueryQueue: the request side (enqueue, reconcile, long-poll) and the background side
(process, execute, heartbeat, ack) of `queue-design.txt`, in asyncio.

It never holds queue state: every transition is a QUEUE command through the driver, so
any number of QueryQueue objects in any number of processes share one queue.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from queryqueue.engine import events as ev
from queryqueue.engine.aio import wait_within
from queryqueue.engine.clock import Clock, SystemClock
from queryqueue.engine.connection import AddedToQueue, QueryDef, QueueConnection
from queryqueue.engine.driver import LocalQueueDriver, QueueDriver
from queryqueue.engine.errors import (
    ContinueWaitError,
    InvalidCommandError,
    QueryCancelledError,
    QueryError,
    QueryTimeoutError,
    QueueClosedError,
    ResultTooLargeError,
)
from queryqueue.engine.events import EventLogger, Events
from queryqueue.engine.handlers import (
    CancelHandler,
    QueryHandler,
    SendProcessMessage,
    SetCancelHandler,
    StreamHandler,
)
from queryqueue.engine.hashing import hash_query_key, js_number
from queryqueue.engine.outcome import (
    CANCELLED_MESSAGE,
    encode_cancelled,
    encode_error,
    encode_result,
    parse_result,
)
from queryqueue.engine.responses import QueueId
from queryqueue.engine.retrieved import RetrievedQuery
from queryqueue.engine.store import QueueStore
from queryqueue.engine.stream import QueryStream
from queryqueue.engine.validation import MAX_EXTERNAL_ID_LENGTH, MAX_PRIORITY, MIN_PRIORITY

SendCancelMessage = Callable[[QueryDef, QueueId | None], Awaitable[None]]

STREAM_HANDLER = "stream"
REAP_INTERVAL_MS = 1000

# The fast track is for latency-sensitive work: QueryCache submits user queries at 10.
FAST_TRACK_PRIORITY = 10
HEARTBEAT_LOG_INTERVAL = 5 * 60.0


@dataclass(frozen=True, slots=True)
class _Request:
    """One caller's query, as `execute_in_queue` and `run` take it."""

    query_handler: str
    query_key: Any
    query: Any
    priority: int
    stage_query_key: Any
    request_id: str | None
    span_id: str | None


@dataclass(eq=False)
class _Execution:
    """One query executing in this process."""

    retrieved: RetrievedQuery
    cancel_handler: Any = None
    cancelled: bool = False  # cancelled from outside: the handler's end is not an error of its own
    external_cancel_fired: bool = False
    finished: bool = False  # the handler is done: the heartbeat loop must end
    handler_task: asyncio.Future[Any] | None = None
    side_tasks: set[asyncio.Task[Any]] = field(default_factory=set)


class QueryQueue:
    def __init__(
        self,
        prefix: str,
        *,
        query_handlers: Mapping[str, QueryHandler],
        cancel_handlers: Mapping[str, CancelHandler] | None = None,
        stream_handler: StreamHandler | None = None,
        concurrency: int = 2,
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
    ) -> None:
        for name, value in [
            ("continue_wait_timeout", continue_wait_timeout),
            ("execution_timeout", execution_timeout),
            ("orphaned_timeout", orphaned_timeout),
            ("heartbeat_interval", heartbeat_interval),
        ]:
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be a positive integer, got {concurrency!r}")
        self.prefix = prefix
        self.query_handlers = dict(query_handlers)
        self.cancel_handlers = dict(cancel_handlers or {})
        self.stream_handler = stream_handler
        self.concurrency = concurrency
        self.continue_wait_timeout = continue_wait_timeout
        self.execution_timeout = execution_timeout
        self.orphaned_timeout = orphaned_timeout
        self.heartbeat_interval = heartbeat_interval
        self.process_uid = process_uid or str(uuid.uuid4())
        self.fast_track = fast_track
        # False where another process reconciles for this one (a supervisor for the
        # processes of its worker pool): then this process reconciles only to pick up its
        # own stream items.
        self.reconcile = reconcile
        self.clock: Clock = clock or SystemClock()
        self.events = Events(logger)
        if driver is None or isinstance(driver, QueueStore):
            driver = LocalQueueDriver(driver)
        self.driver: QueueDriver = driver
        self.connection = QueueConnection(
            driver,
            prefix,
            process_uid=self.process_uid,
            concurrency=concurrency,
            continue_wait_timeout=continue_wait_timeout,
            orphaned_timeout=orphaned_timeout,
            heartbeat_timeout=heartbeat_interval * 4,
        )
        self.send_process_message_fn: SendProcessMessage = (
            send_process_message_fn or self._execute_in_background
        )
        self.send_cancel_message_fn: SendCancelMessage = (
            send_cancel_message_fn or self._cancel_in_background
        )
        self.streams: dict[str, QueryStream] = {}
        self._stream_waiters: dict[str, set[asyncio.Future[QueryStream]]] = {}
        self._reconcile_task: asyncio.Task[None] | None = None
        self._reconcile_again = False
        self.reconcile_runs = 0  # completed reconcileQueueImpl runs, for stats and tests
        self._reaped_at: int | None = None  # when this process last looked for stalled items
        self._executions: dict[QueueId, _Execution] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._closing = False  # shutdown() in progress: start nothing new meanwhile
        self._closed = False  # close(): refuses new work for good
        self._threads_lock = threading.Lock()
        self._threads_done = threading.Condition(self._threads_lock)
        self._handler_threads = 0

    # -- request side --------------------------------------------------------------------

    def redis_hash(self, query_key: Any, *, persistent: bool = False) -> str:
        return hash_query_key(query_key, persistent=persistent, process_uid=self.process_uid)

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
        return await self._execute(
            _Request(
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
    ) -> Any:
        """Enqueue (or join) a query and wait for its result, however long it takes.

        Re-polls the same item while it runs; raises `QueryTimeoutError` once `timeout`
        seconds have passed without a result (the query itself goes on, for other callers),
        `QueryCancelledError` if it was cancelled, `QueryError` if its handler failed."""
        if timeout is not None and not timeout > 0:
            raise InvalidCommandError(f"timeout must be positive seconds, got {timeout!r}")
        request = _Request(
            query_handler, query_key, query, priority, stage_query_key, request_id, None
        )
        deadline = None if timeout is None else self.clock.now_ms() + round(timeout * 1000)
        queue_id: QueueId | None = None
        while True:
            wait = self.continue_wait_timeout
            if deadline is not None:
                remaining = (deadline - self.clock.now_ms()) / 1000
                if remaining <= 0:
                    raise QueryTimeoutError(
                        f"no result for the query within {js_number(timeout or 0)} s"
                    )
                wait = min(wait, remaining)
            if queue_id is not None:
                # A result by queue id reads many times: another caller's read by path
                # cannot have taken it from us.
                found = await self.connection.get_result_by_id(queue_id)
                if found is not None:
                    return parse_result(found)
            try:
                return await self._execute(request, wait)
            except ContinueWaitError as exc:
                # None after a retry outcome: that item is gone, the next poll enqueues anew.
                queue_id = exc.queue_id

    async def _execute(self, request: _Request, wait: float) -> Any:
        self._check_request(request)
        is_stream = request.query_handler == STREAM_HANDLER
        flags: Mapping[str, Any] = request.query if isinstance(request.query, Mapping) else {}
        query_key_hash = self.redis_hash(request.query_key, persistent=is_stream)
        external_id = _external_id(request.request_id)
        conn = self.connection
        if not flags.get("forceBuild"):
            found = await conn.get_result(query_key_hash, external_id)
            if found is not None and not (isinstance(found, dict) and found.get("streamResult")):
                return parse_result(found)
        elif await conn.get_query_def(query_key_hash) is not None:
            return None  # a build of this key is already queued or running
        # Subscribe before anything can dispatch the stream: a handler that starts at once
        # would otherwise emit into no listener.
        stream_waiter = self._subscribe_stream(query_key_hash) if is_stream else None
        waiting: dict[str, Any] | None = None
        try:
            added = await self._enqueue(request, query_key_hash, external_id, flags)
            waiting = await self._start(request, query_key_hash, added, flags)
            if stream_waiter is not None:
                return await self._wait_for_stream(query_key_hash, stream_waiter)
            if flags.get("isJob"):
                return None
            result = await conn.get_result_blocking(query_key_hash, added.queue_id, wait)
            if result is None:
                raise ContinueWaitError(queue_id=added.queue_id)
            return parse_result(result)
        except BaseException:
            if waiting is not None:
                self.events.emit(ev.FINISHED_WAITING, waiting)
            raise
        finally:
            if stream_waiter is not None:
                self._unsubscribe_stream(query_key_hash, stream_waiter)

    def _check_request(self, request: _Request) -> None:
        priority = request.priority
        if (
            not isinstance(priority, int)
            or isinstance(priority, bool)
            or not (MIN_PRIORITY <= priority <= MAX_PRIORITY)
        ):
            raise InvalidCommandError(
                f"Priority should be between {MIN_PRIORITY} and {MAX_PRIORITY}, got {priority!r}"
            )
        if self._closed:
            raise QueueClosedError(f"the queue {self.prefix!r} is closed")
        if request.query_handler == STREAM_HANDLER:
            if self.stream_handler is None:
                raise InvalidCommandError("a stream query needs a stream_handler")
        elif request.query_handler not in self.query_handlers:
            raise InvalidCommandError(f"unknown query handler {request.query_handler!r}")

    async def _enqueue(
        self,
        request: _Request,
        query_key_hash: str,
        external_id: str | None,
        flags: Mapping[str, Any],
    ) -> AddedToQueue:
        """ADD, or on the fast track ADD_AND_RETRIEVE; joins an identical query in flight."""
        query_def: QueryDef = {
            "queryHandler": request.query_handler,
            "query": request.query,
            "queryKey": request.query_key,
            "stageQueryKey": request.stage_query_key,
            "priority": request.priority,
            "requestId": request.request_id,
            "addedToQueueTime": self.clock.now_ms(),
        }
        try:
            orjson.dumps(query_def)
        except TypeError as exc:
            raise InvalidCommandError(
                f"query and query key must be JSON serializable: {exc}"
            ) from None
        is_stream = request.query_handler == STREAM_HANDLER
        return await self.connection.add_to_queue(
            query_key_hash,
            query_def,
            priority=request.priority,
            orphaned_timeout=flags.get("orphanedTimeout", self.orphaned_timeout),
            external_id=external_id,
            exclusive=is_stream,
            fast_track=self.fast_track and request.priority >= FAST_TRACK_PRIORITY,
        )

    async def _start(
        self,
        request: _Request,
        query_key_hash: str,
        added: AddedToQueue,
        flags: Mapping[str, Any],
    ) -> dict[str, Any]:
        """Get the item going: hand it off at once if the fast track retrieved it, else
        reconcile. Returns the context of the "Waiting for query" event it emitted."""
        context = {
            "queueId": added.queue_id,
            "spanId": request.span_id,
            "queryKey": request.query_key,
            "queuePrefix": self.prefix,
            "requestId": request.request_id,
            "waitingForRequestId": request.request_id,
        }
        fast_tracked = added.retrieved is not None
        if added.added:
            self.events.emit(
                ev.ADDED_TO_QUEUE,
                {
                    **context,
                    "priority": request.priority,
                    "queueSize": added.queue_size,
                    "forceBuild": bool(flags.get("forceBuild")),
                    "persistent": request.query_handler == STREAM_HANDLER,
                    "fastTrack": fast_tracked,
                },
            )
        if added.retrieved is not None:
            await self._fast_track(query_key_hash, added, context)
            active_keys, to_process = list(added.active_keys), list[str]()
        else:
            if self.reconcile or request.query_handler == STREAM_HANDLER:
                await self.reconcile_queue()
            if not added.added:
                context = await self._joined_context(query_key_hash, added, context)
            if self.events.wanted(ev.WAITING_FOR_QUERY):
                active_keys, to_process, _ = await self.connection.get_query_stage_state(True)
            else:  # a listing of the whole queue per request, for nobody: skipped
                active_keys, to_process = [], []
        self.events.emit(
            ev.WAITING_FOR_QUERY,
            {
                **context,
                "queueSize": added.queue_size,
                "activeQueryKeys": active_keys,
                "toProcessQueryKeys": to_process,
                "active": query_key_hash in active_keys,
                "queueIndex": to_process.index(query_key_hash)
                if query_key_hash in to_process
                else -1,
                "fastTrack": fast_tracked,
            },
        )
        return context

    async def _fast_track(
        self, query_key_hash: str, added: AddedToQueue, context: dict[str, Any]
    ) -> None:
        """ADD_AND_RETRIEVE made the item active and ours: hand it off now, no reconcile."""
        assert added.retrieved is not None
        retrieved = RetrievedQuery(
            query_key_hash, added.queue_id, added.queue_id, added.queue_size, added.retrieved
        )
        try:
            await self.send_process_message_fn(retrieved)
        except Exception as exc:
            # The item is active and ours: only the stalled path can reclaim it now.
            self.events.emit(ev.ERROR_PROCESSING_MESSAGE, {**context, "error": repr(exc)})
            raise ContinueWaitError(queue_id=added.queue_id) from exc

    async def _joined_context(
        self, query_key_hash: str, added: AddedToQueue, context: dict[str, Any]
    ) -> dict[str, Any]:
        """Dedup: an identical query was in flight; the events name whose request it is."""
        existing = await self.connection.get_query_def(query_key_hash, added.queue_id)
        if existing is None:
            return context
        return {
            **context,
            "queryKey": existing.get("queryKey"),
            "waitingForRequestId": existing.get("requestId"),
        }

    # -- reconcile -------------------------------------------------------------------------

    async def reconcile_queue(self) -> None:
        """Single-flight: callers during a run share it and cause exactly one more run."""
        if self._closing or self._closed:
            return
        if self._reconcile_task is None:
            self._reconcile_again = False
            self._reconcile_task = asyncio.ensure_future(self._reconcile_loop())
        else:
            self._reconcile_again = True
        await asyncio.shield(self._reconcile_task)

    async def _reconcile_loop(self) -> None:
        # Cube clears the flag only when it creates a run: calls that arrive after the run
        # was created (even before it started) cause exactly one more.
        try:
            while True:
                await self._reconcile_queue_impl()
                self.reconcile_runs += 1
                if not self._reconcile_again:
                    return
                self._reconcile_again = False
        finally:
            self._reconcile_task = None

    async def _reconcile_queue_impl(self) -> None:
        conn = self.connection
        # Stalled and orphaned items are looked for at most once per REAP_INTERVAL_MS per
        # process: their timeouts are tens of seconds, and every process reconciles, so
        # this costs a reaped item at most that much more life and saves a round trip on
        # the path of every query.
        now = self.clock.now_ms()
        if self._reaped_at is None or now - self._reaped_at >= REAP_INTERVAL_MS:
            self._reaped_at = now
            to_cancel = await conn.get_queries_to_cancel()
            if to_cancel:
                await asyncio.gather(*(self._remove_orphaned(h, q) for h, q in to_cancel))
        # One round trip for both listings: PENDING's limit is trimmed once ACTIVE is known.
        active, to_process = await asyncio.gather(
            conn.get_active_queries(), conn.get_to_process_queries(limit=self.concurrency)
        )
        to_process_limit = 1 if len(active) >= self.concurrency else self.concurrency - len(active)
        # The store hides other processes' persistent items already; the suffix check keeps
        # the design's rule explicit should a driver not.
        mine = [
            (h, q) for h, q in to_process if "@" not in h or h.endswith(f"@{self.process_uid}")
        ][:to_process_limit]
        await asyncio.gather(*(self.process_query(h, q) for h, q in mine))

    async def _remove_orphaned(self, query_key_hash: str, queue_id: QueueId) -> None:
        query_def = await self.connection.get_query_and_remove(query_key_hash, queue_id)
        if query_def is None:
            return
        self.events.emit(
            ev.REMOVING_ORPHANED,
            {
                "queueId": queue_id,
                "queryKey": query_def.get("queryKey"),
                "queuePrefix": self.prefix,
                "requestId": query_def.get("requestId"),
            },
        )
        await self.send_cancel_message_fn(query_def, queue_id)

    # -- background side ----------------------------------------------------------------------

    async def process_query(self, query_key_hash: str, queue_id: QueueId | None = None) -> None:
        """Retrieve the item and hand it off. Never executes it: the hand-off returns first."""
        try:
            got = await self.connection.retrieve_for_processing(query_key_hash)
            activated = query_key_hash in got.active_keys
            if got.query is None or got.queue_id is None or not activated:
                self.events.emit(
                    ev.SKIP_PROCESSING,
                    {
                        "queueId": queue_id,
                        "queryKey": query_key_hash,
                        "queuePrefix": self.prefix,
                        "activeKeys": list(got.active_keys),
                        "activated": activated,
                        "queryExists": got.query is not None,
                    },
                )
                await self.connection.free_processing_lock(query_key_hash, queue_id)
                return
            retrieved = RetrievedQuery(
                query_key_hash, got.queue_id, got.queue_id, got.queue_size, got.query
            )
            try:
                await self.send_process_message_fn(retrieved)
            except Exception as exc:
                self.events.emit(
                    ev.ERROR_PROCESSING_MESSAGE,
                    {
                        "queueId": got.queue_id,
                        "queryKey": got.query.get("queryKey"),
                        "queuePrefix": self.prefix,
                        "error": repr(exc),
                    },
                )
        except Exception as exc:
            self.events.emit(
                ev.QUEUE_STORAGE_ERROR,
                {
                    "queueId": queue_id,
                    "queryKey": query_key_hash,
                    "queuePrefix": self.prefix,
                    "error": repr(exc),
                },
            )

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

    async def execute_query(self, retrieved: RetrievedQuery) -> None:
        """Run a retrieved item to its ACK, then reconcile. Errors are logged, never raised."""
        query = retrieved.query
        query_key_hash, queue_id = retrieved.query_key_hash, retrieved.queue_id
        context = self._execution_context(retrieved)
        execution = _Execution(retrieved)
        self._executions[queue_id] = execution
        conn = self.connection
        try:
            start = self.clock.now_ms()
            self.events.emit(
                ev.PERFORMING_QUERY,
                {**context, "timeInQueue": start - query.get("addedToQueueTime", start)},
            )
            await conn.optimistic_query_update(query_key_hash, {"startQueryTime": start}, queue_id)
            heartbeat = asyncio.ensure_future(self._heartbeat(execution, context))
            started = time.monotonic()
            try:
                result = await self._run_handler(execution)
                self.events.emit(
                    ev.PERFORMING_COMPLETED, {**context, "duration": _ms_since(started)}
                )
            except Exception as exc:
                result = encode_error(exc)
                # Logged here, once, with its traceback; callers get the text in the result.
                self.events.emit(
                    ev.ERROR_WHILE_QUERYING,
                    {**context, "duration": _ms_since(started), "error": repr(exc)},
                    exc_info=exc,
                )
                if isinstance(exc, QueryTimeoutError):
                    current = await conn.get_query_def(query_key_hash, queue_id)
                    if current is not None:
                        self.events.emit(ev.CANCELLING_TIMEOUT, context)
                        await self.send_cancel_message_fn(
                            {**current, "cancelHandler": execution.cancel_handler}, queue_id
                        )
            finally:
                execution.finished = True
                heartbeat.cancel()
                await asyncio.gather(heartbeat, *execution.side_tasks, return_exceptions=True)
            if not await self._acknowledge(query_key_hash, queue_id, result, context):
                self.events.emit(
                    ev.ORPHANED_RESULT,
                    {
                        **context,
                        "warn": "Result for query was not set: the item is no longer in the queue",
                    },
                )
            if self.reconcile:
                await self.reconcile_queue()
        except Exception as exc:
            self.events.emit(ev.QUEUE_STORAGE_ERROR, {**context, "error": repr(exc)})
        finally:
            self._executions.pop(queue_id, None)

    async def _acknowledge(
        self, query_key_hash: str, queue_id: QueueId, result: str, context: dict[str, Any]
    ) -> bool:
        """ACK with the result; one that no transport can carry fails the query instead,
        so its waiters hear why rather than wait for a reap."""
        conn = self.connection
        try:
            return await conn.set_encoded_result_and_remove_query(query_key_hash, result, queue_id)
        except ResultTooLargeError as exc:
            self.events.emit(ev.ERROR_WHILE_QUERYING, {**context, "error": repr(exc)})
            return await conn.set_encoded_result_and_remove_query(
                query_key_hash, encode_error(exc), queue_id
            )

    async def _run_handler(self, execution: _Execution) -> str:
        """Run the handler; its result as the JSON text to ACK with."""
        retrieved = execution.retrieved
        query = retrieved.query
        name = query.get("queryHandler")
        loop = asyncio.get_running_loop()

        def set_cancel_handler(value: Any) -> None:
            # Called from the handler, possibly in a worker thread.
            execution.cancel_handler = value

            def record() -> None:
                task = asyncio.ensure_future(self._record_cancel_handler(execution, value))
                execution.side_tasks.add(task)

            if _in_loop(loop):
                record()
            else:
                loop.call_soon_threadsafe(record)

        if name == STREAM_HANDLER:
            if self.stream_handler is None:
                raise QueryError("no stream_handler for a stream query")
            stream = self._create_query_stream(retrieved.query_key_hash, query.get("query"))
            task = asyncio.ensure_future(self.stream_handler(query.get("query"), stream))
            execution.handler_task = task
            try:
                await task
            except asyncio.CancelledError:
                await stream.end(QueryCancelledError(CANCELLED_MESSAGE))
                if execution.cancelled and task.cancelled():
                    raise QueryCancelledError(CANCELLED_MESSAGE) from None
                raise
            except Exception as exc:
                await stream.end(exc)
                raise
            finally:
                if self.streams.get(retrieved.query_key_hash) is stream:
                    del self.streams[retrieved.query_key_hash]
            await stream.end()
            return '{"streamResult":true}'

        handler = self.query_handlers.get(str(name))
        if handler is None:
            raise QueryError(f"no query handler {name!r}")
        if inspect.iscoroutinefunction(handler):
            execution.handler_task = asyncio.ensure_future(
                handler(query.get("query"), set_cancel_handler)
            )
        else:
            # A sync handler runs in a thread so this loop keeps heartbeating.
            execution.handler_task = asyncio.ensure_future(
                asyncio.to_thread(self._in_thread, handler, query.get("query"), set_cancel_handler)
            )
        try:
            value = await wait_within(execution.handler_task, self.execution_timeout)
        except TimeoutError:
            execution.handler_task.cancel()
            raise QueryTimeoutError(
                f"Query execution timeout after {js_number(self.execution_timeout / 60)} min of waiting"
            ) from None
        except asyncio.CancelledError:
            if execution.cancelled and execution.handler_task.cancelled():
                raise QueryCancelledError(CANCELLED_MESSAGE) from None
            execution.handler_task.cancel()  # this execution is being stopped (shutdown)
            await asyncio.gather(execution.handler_task, return_exceptions=True)
            raise
        if inspect.isawaitable(value):
            value = await value
        return encode_result(value)

    def _in_thread(
        self, handler: QueryHandler, query: Any, set_cancel_handler: SetCancelHandler
    ) -> Any:
        with self._threads_lock:
            self._handler_threads += 1
        try:
            return handler(query, set_cancel_handler)
        finally:
            with self._threads_lock:
                self._handler_threads -= 1
                if not self._handler_threads:
                    self._threads_done.notify_all()

    def wait_for_handler_threads(self, timeout: float | None = None) -> bool:
        """Block until no sync handler runs in a thread; False on timeout."""
        with self._threads_done:
            return self._threads_done.wait_for(lambda: not self._handler_threads, timeout)

    @property
    def handler_threads(self) -> int:
        """Sync handlers still running in threads — including ones whose execution was
        cancelled or timed out, which Python cannot stop (a worker process can be)."""
        with self._threads_lock:
            return self._handler_threads

    async def _record_cancel_handler(self, execution: _Execution, value: Any) -> None:
        retrieved = execution.retrieved
        try:
            await self.connection.optimistic_query_update(
                retrieved.query_key_hash, {"cancelHandler": value}, retrieved.queue_id
            )
        except Exception as exc:
            self.events.emit(
                ev.ERROR_QUERY_UPDATE, {**self._execution_context(retrieved), "error": repr(exc)}
            )

    async def _heartbeat(self, execution: _Execution, context: dict[str, Any]) -> None:
        retrieved = execution.retrieved
        conn = self.connection
        last_logged = time.monotonic()
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            if execution.finished:  # ends even if a cancellation went astray
                return
            if time.monotonic() - last_logged >= HEARTBEAT_LOG_INTERVAL:
                last_logged = time.monotonic()
                self.events.emit(ev.HEARTBEAT, context)
            try:
                await conn.update_heartbeat(retrieved.query_key_hash, retrieved.queue_id)
            except Exception as exc:
                self.events.emit(ev.ERROR_UPDATING_HEARTBEAT, {**context, "error": repr(exc)})
            if execution.external_cancel_fired:
                continue
            try:
                current = await conn.get_query_def(retrieved.query_key_hash, retrieved.queue_id)
                if current is None:  # removed by someone else (manual cancel elsewhere, reaped)
                    await self._cancel_external(execution)
            except Exception as exc:
                self.events.emit(ev.ERROR_CHECKING_EXTERNAL, {**context, "error": repr(exc)})

    def cancel_execution(self, queue_id: QueueId) -> bool:
        """The item this process runs was removed elsewhere (a supervisor says so at once):
        stop it now with its cancel handler, as its next heartbeat would. False if it does
        not run here or was stopped already."""
        execution = self._executions.get(queue_id)
        if execution is None or execution.external_cancel_fired or execution.finished:
            return False
        self._spawn(self._cancel_external(execution))
        return True

    async def _cancel_external(self, execution: _Execution) -> None:
        if execution.external_cancel_fired:  # once, whoever notices first
            return
        execution.external_cancel_fired = True
        retrieved = execution.retrieved
        self.events.emit(ev.CANCELLING_EXTERNAL, self._execution_context(retrieved))
        await self.process_cancel(
            {**retrieved.query, "cancelHandler": execution.cancel_handler}, retrieved.queue_id
        )

    async def process_cancel(self, query_def: QueryDef, queue_id: QueueId | None) -> None:
        """Call the cancel handler of the query's handler, and stop the query if it runs in
        this process (an async handler stops; a thread can only be abandoned)."""
        name = query_def.get("queryHandler")
        execution = self._executions.get(queue_id) if queue_id else None
        task = execution.handler_task if execution is not None else None
        running_here = execution is not None and task is not None and not task.done()
        if execution is not None:
            # Delivered: the heartbeat must not report the removal as an external cancel too.
            execution.external_cancel_fired = True
            execution.cancelled = running_here
        try:
            cancel = self.cancel_handlers.get(str(name))
            if cancel is None:
                if not running_here:
                    raise QueryError(f"No cancel handler for {name}")
            else:
                outcome = cancel(query_def)
                if inspect.isawaitable(outcome):
                    await outcome
        except Exception as exc:
            self.events.emit(
                ev.ERROR_WHILE_CANCEL,
                {
                    "queueId": queue_id,
                    "queryKey": query_def.get("queryKey"),
                    "queuePrefix": self.prefix,
                    "error": repr(exc),
                },
            )
        finally:
            if running_here and task is not None:
                task.cancel()

    # -- cancellation and introspection ---------------------------------------------------------

    async def cancel_query(self, query_key_hash: str, queue_id: QueueId | None = None) -> bool:
        """Cancel a queued or running query: its waiters get `QueryCancelledError`, the
        execution is stopped and its cancel handler called. False if nothing was cancelled."""
        query_def = await self.connection.cancel_query(query_key_hash, queue_id, encode_cancelled())
        if queue_id is None:
            # Cancelled by key: if it runs here, name the execution so it is stopped now.
            queue_id = next(
                (
                    qid
                    for qid, e in self._executions.items()
                    if e.retrieved.query_key_hash == query_key_hash
                ),
                None,
            )
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
        cancelled = []
        for entry in await self.get_queries():
            if entry.get("requestId") == request_id:
                await self.cancel_query(entry["queryKeyHash"], entry.get("queueId"))
                cancelled.append(entry)
        return cancelled

    async def get_queries(self) -> list[QueryDef]:
        """Every item of the queue with its statuses: orphaned, stalled, active, toProcess."""
        conn = self.connection
        lists = await asyncio.gather(
            conn.get_orphaned_queries(),
            conn.get_stalled_queries(),
            conn.get_active_queries(),
            conn.get_to_process_queries(),
        )
        merged: dict[str, QueryDef] = {}
        for status, entries in zip(
            ("orphaned", "stalled", "active", "toProcess"), lists, strict=True
        ):
            for query_key_hash, queue_id in entries:
                if query_key_hash not in merged:
                    query_def = await conn.get_query_def(query_key_hash, queue_id)
                    if query_def is None:
                        continue
                    # Cube's shape: `queryKey` is the hash, so cancel_query(entry["queryKey"])
                    # cancels the entry (the caller's key is in the item's payload only).
                    merged[query_key_hash] = {
                        **query_def,
                        "queryKey": query_key_hash,
                        "queryKeyHash": query_key_hash,
                        "queueId": queue_id,
                        "status": [],
                    }
                merged[query_key_hash]["status"].append(status)
        return list(merged.values())

    async def fetch_query_stage_state(self) -> tuple[list[str], list[str], dict[str, QueryDef]]:
        return await self.connection.get_query_stage_state(False)

    async def get_query_stage(
        self,
        stage_query_key: Any,
        priority_filter: int | None = None,
        stage_state: tuple[list[str], list[str], dict[str, QueryDef]] | None = None,
    ) -> dict[str, Any] | None:
        """`{"stage": "Executing query", "timeElapsed": ms}`, `{"stage": "#N in queue"}` or None."""
        active, to_process, defs = stage_state or await self.fetch_query_stage_state()
        wanted = self.redis_hash(stage_query_key)
        for query_key_hash, query_def in defs.items():
            if query_def.get("stageQueryKey") is None:
                continue
            if self.redis_hash(query_def["stageQueryKey"]) != wanted:
                continue
            if priority_filter is not None and query_def.get("priority") != priority_filter:
                continue
            if query_key_hash in active:
                started = query_def.get("startQueryTime")
                return {
                    "stage": "Executing query",
                    "timeElapsed": None if started is None else self.clock.now_ms() - started,
                }
            queue = [
                h
                for h in to_process
                if priority_filter is None or defs.get(h, {}).get("priority") == priority_filter
            ]
            if query_key_hash in queue:
                return {"stage": f"#{queue.index(query_key_hash) + 1} in queue"}
            return None
        return None

    # -- streams --------------------------------------------------------------------------------

    def get_query_stream(self, query_key_hash: str) -> QueryStream | None:
        return self.streams.get(query_key_hash)

    def _create_query_stream(self, query_key_hash: str, query: Any) -> QueryStream:
        aliases = query.get("aliasNameToMember") if isinstance(query, Mapping) else None
        stream = QueryStream(query_key_hash, aliases)
        self.streams[query_key_hash] = stream
        for waiter in self._stream_waiters.pop(query_key_hash, ()):
            if not waiter.done():
                waiter.set_result(stream)
        return stream

    def _subscribe_stream(self, query_key_hash: str) -> asyncio.Future[QueryStream]:
        waiter: asyncio.Future[QueryStream] = asyncio.get_running_loop().create_future()
        self._stream_waiters.setdefault(query_key_hash, set()).add(waiter)
        return waiter

    def _unsubscribe_stream(self, query_key_hash: str, waiter: asyncio.Future[QueryStream]) -> None:
        waiters = self._stream_waiters.get(query_key_hash)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del self._stream_waiters[query_key_hash]

    async def _wait_for_stream(
        self, query_key_hash: str, waiter: asyncio.Future[QueryStream]
    ) -> QueryStream:
        # The map covers a stream that started before this waiter existed (a joined caller).
        stream = self.streams.get(query_key_hash)
        if stream is not None:
            return stream

        # Only this process may retrieve its stream item, and other processes' ACKs do not
        # reconcile on its behalf: look again whenever a slot frees (the driver says so),
        # and every long-poll period should a nudge be missed.
        def nudged() -> None:
            self._spawn(self.reconcile_queue())

        stop_watching = await self.driver.watch_slots(self.prefix, nudged)
        try:
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
        self._closing = True
        try:
            in_flight = self._reconcile_task is not None
            if self._reconcile_task is not None:
                await asyncio.gather(self._reconcile_task, return_exceptions=True)
            if self._background and grace > 0:
                # Executions may be running other processes' queries: cutting them off
                # would make those run twice once reclaimed.
                await asyncio.wait(list(self._background), timeout=grace)
            await self._stop_background()
        finally:
            self._closing = False
        return in_flight

    async def close(self, grace: float = 30.0) -> None:
        """Shut down, and refuse new work from now on with `QueueClosedError`."""
        self._closed = True
        await self.shutdown(grace)

    async def _stop_background(self) -> None:
        while self._reconcile_task is not None or self._background:
            if self._reconcile_task is not None:
                await asyncio.gather(self._reconcile_task, return_exceptions=True)
            for task in list(self._background):
                task.cancel()
            await asyncio.gather(*self._background, return_exceptions=True)
        handlers = [e.handler_task for e in self._executions.values() if e.handler_task is not None]
        for handler in handlers:
            handler.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    def _execution_context(self, retrieved: RetrievedQuery) -> dict[str, Any]:
        query = retrieved.query
        inner = query.get("query")
        flags: Mapping[str, Any] = inner if isinstance(inner, Mapping) else {}
        return {
            "queueId": retrieved.queue_id,
            "processingId": retrieved.processing_id,
            "queryKey": query.get("queryKey"),
            "queuePrefix": self.prefix,
            "requestId": query.get("requestId"),
            "queueSize": retrieved.queue_size,
            "addedToQueueTime": query.get("addedToQueueTime"),
            "metadata": flags.get("metadata"),
            "preAggregationId": None,
            "newVersionEntry": flags.get("newVersionEntry"),
            "preAggregation": flags.get("preAggregation"),
        }


def _external_id(request_id: str | None) -> str | None:
    """The request id up to its last `-span-`, as Cube derives it (hashed when over-long)."""
    if not request_id:
        return None
    head, sep, _ = request_id.rpartition("-span-")
    external_id = head if sep else request_id
    if len(external_id) > MAX_EXTERNAL_ID_LENGTH:
        external_id = hash_query_key(external_id)
    return external_id


def _ms_since(started: float) -> int:
    return round((time.monotonic() - started) * 1000)


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
