"""The background side of Cube's QueryQueue: execute a retrieved query, heartbeat it,
cancel it, ACK it — what huey's consumer and saq's worker are to their queues.

One `Executor` per `QueryQueue`, holding the executions running in this process. Its
heartbeat sleeps on the queue's injected clock, so tests step it instead of waiting.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from queryqueue.engine import events as ev
from queryqueue.engine import retrying
from queryqueue.engine.aio import wait_within
from queryqueue.engine.binary import Outcome
from queryqueue.engine.cancelling import call_cancel_handler
from queryqueue.engine.connection import QueryDef
from queryqueue.engine.errors import (
    CommandTimeoutError,
    QueryCancelledError,
    QueryError,
    QueryTimeoutError,
    ResultTooLargeError,
    StoreError,
    SupervisorUnavailableError,
)
from queryqueue.engine.execution import Execution, execution_context, query_of
from queryqueue.engine.handlers import QueryHandler, SetCancelHandler
from queryqueue.engine.loop_run import (
    LoopRun,
    LoopRunWatch,
    cancel_from_a_thread,
    stoppable_from_a_thread,
)
from queryqueue.engine.outcome import CANCELLED_MESSAGE, encode_error
from queryqueue.engine.responses import QueueId
from queryqueue.engine.retrieved import RetrievedQuery
from queryqueue.engine.retrying import DEFAULT_POLICY
from queryqueue.engine.threads import HandlerThreads, ThreadedCalls

if TYPE_CHECKING:
    from queryqueue.engine.queue import QueryQueue

STREAM_HANDLER = "stream"
HEARTBEAT_LOG_INTERVAL_MS = 5 * 60 * 1000
ACK_RETRY_FIRST = 0.05
ACK_RETRY_MAX = 2.0


class Executor:
    """Runs the queries a `QueryQueue` hands to this process, to their ACK."""

    ack_retry_timeout = 30.0  # seconds an ACK is retried through an outage
    # Seconds this loop's thread waits on the spot for a sync handler's outcome before
    # leaving it to come through the loop (`HandlerThreads.run`): 0 but in a process
    # whose loop has nothing else to do while its one query runs (a pool's worker).
    sync_handler_wait = 0.0
    # Set in a pool's worker (its loop has nothing else to do): a sync handler runs on the
    # loop's thread, sparing two thread wake-ups a query, and this watches it.
    watch: LoopRunWatch | None = None

    def __init__(self, queue: QueryQueue) -> None:
        self.queue = queue
        self.executions: dict[QueueId, Execution] = {}
        self._threads = HandlerThreads()
        self._in_threads = ThreadedCalls()

    async def execute_query(
        self, retrieved: RetrievedQuery, *, acknowledging: Callable[[], None] | None = None
    ) -> bool:
        """Run a retrieved item to its ACK, then reconcile. Errors are logged, never raised;
        False when the outcome could not be reported (the store unreachable through every
        retry): whoever handed it here should give the item back. `acknowledging` is
        called once the outcome is known and its ACK goes out (before its answer): a
        caller running one query at a time may start its next then."""
        query_key_hash, queue_id = retrieved.query_key_hash, retrieved.queue_id
        context = execution_context(self.queue.prefix, retrieved)
        execution = Execution(retrieved)
        self.executions[queue_id] = execution
        try:
            result = await self._outcome(execution, context)
            if acknowledging is not None:
                acknowledging()
            if not await self._acknowledge(query_key_hash, queue_id, result, context):
                self.queue.events.emit(
                    ev.ORPHANED_RESULT,
                    {
                        **context,
                        "warn": "Result for query was not set: the item is no longer in the queue",
                    },
                )
        except Exception as exc:
            self.queue.events.emit(ev.QUEUE_STORAGE_ERROR, {**context, "error": repr(exc)})
            return False
        finally:
            self.executions.pop(queue_id, None)
        if self.queue.reconcile:
            try:  # the outcome is stored: a failing reconcile gives nothing back
                await self.queue.reconcile_queue()
            except Exception as exc:
                self.queue.events.emit(ev.QUEUE_STORAGE_ERROR, {**context, "error": repr(exc)})
        return True

    def running(self, query_key_hash: str) -> QueueId | None:
        """The queue id of the execution of this query here, if one runs."""
        return next(
            (q for q, e in self.executions.items() if e.retrieved.query_key_hash == query_key_hash),
            None,
        )

    async def _outcome(self, execution: Execution, context: dict[str, Any]) -> Outcome:
        """Run the handler, heartbeating meanwhile; its outcome as the JSON text to ACK."""
        retrieved = execution.retrieved
        query = retrieved.query
        start = retrieved.started_ms
        if start is None:
            start = self.queue.clock.now_ms()
            # Not waited for: it goes out ahead of anything the handler sends, and the ACK
            # waits for it (side tasks end first), so the handler starts a round trip sooner
            # and a store outage right now costs only this record, not the run.
            record(self.queue, execution, {"startQueryTime": start})
        self.queue.events.emit(
            ev.PERFORMING_QUERY,
            {**context, "timeInQueue": start - query.get("addedToQueueTime", start)},
        )
        # A handler on the loop's thread leaves no turn to beat in: the pool that handed
        # the item over beats it.
        watch = self._watch_for(str(query.get("queryHandler")))
        heartbeat = (
            asyncio.ensure_future(self._heartbeat(execution, context)) if watch is None else None
        )
        started = time.monotonic()
        policy = self.queue.handler_policies.get(str(query.get("queryHandler")), DEFAULT_POLICY)
        execution.timeout = policy.budget(self.queue.execution_timeout, query)
        try:
            result = await retrying.attempts(
                functools.partial(self._run_handler, execution, watch), policy, execution.timeout,
                self.queue.clock, retrying.reporting(
                    self.queue.events, context, functools.partial(record, self.queue, execution)
                ),
            )  # fmt: skip
            self.queue.events.emit(
                ev.PERFORMING_COMPLETED, {**context, "duration": _ms_since(started)}
            )
        except QueryCancelledError as exc:
            result = encode_error(exc)
            # Someone's decision, not a failure: a warning, with no traceback to page on.
            duration = _ms_since(started)
            self.queue.events.emit(ev.QUERY_CANCELLED, {**context, "duration": duration})
        except Exception as exc:
            result = encode_error(exc)
            # Logged here, once, with its traceback; callers get the text in the result.
            self.queue.events.emit(
                ev.ERROR_WHILE_QUERYING,
                {**context, "duration": _ms_since(started), "error": repr(exc)},
                exc_info=exc,
            )
            if isinstance(exc, QueryTimeoutError) and execution.stopped is None:  # (else done)
                await self._cancel_timed_out(execution, context)
        finally:
            execution.finished = True
            # Not waited for: cancelled at a sleep it sends nothing more, and one in flight
            # went out before the ACK either way (waiting cost the ACK two loop turns).
            if heartbeat is not None:
                heartbeat.cancel()
                heartbeat.add_done_callback(_quietly)
            if execution.side_tasks:
                await asyncio.gather(*execution.side_tasks, return_exceptions=True)
        return result

    async def _cancel_timed_out(self, execution: Execution, context: dict[str, Any]) -> None:
        retrieved = execution.retrieved
        conn = self.queue.connection
        current = await conn.get_query_def(retrieved.query_key_hash, retrieved.queue_id)
        if current is not None:
            self.queue.events.emit(ev.CANCELLING_TIMEOUT, context)
            await self.queue.send_cancel_message_fn(
                {**current, "cancelHandler": execution.cancel_handler}, retrieved.queue_id
            )

    async def _acknowledge(
        self, query_key_hash: str, queue_id: QueueId, result: Outcome, context: dict[str, Any]
    ) -> bool:
        """ACK with the result; one that no transport can carry fails the query instead,
        so its waiters hear why rather than wait for a reap. Through an outage (a store
        restarting) the ACK, idempotent by queue id, is retried with backoff for up to
        `ack_retry_timeout` seconds on the queue's clock."""
        conn = self.queue.connection
        delay, waited = ACK_RETRY_FIRST, 0.0
        while True:
            try:
                return await conn.set_encoded_result_and_remove_query(
                    query_key_hash, result, queue_id
                )
            except ResultTooLargeError as exc:
                self.queue.events.emit(ev.ERROR_WHILE_QUERYING, {**context, "error": repr(exc)})
                result = encode_error(exc)
            except (StoreError, SupervisorUnavailableError, CommandTimeoutError) as exc:
                if waited >= self.ack_retry_timeout:
                    raise
                self.queue.events.emit(ev.QUEUE_STORAGE_ERROR, {**context, "error": repr(exc)})
                await self.queue.clock.sleep(delay)
                waited, delay = waited + delay, min(delay * 2, ACK_RETRY_MAX)

    async def _run_handler(
        self, execution: Execution, watch: LoopRunWatch | None, seconds: float
    ) -> Outcome:
        """Run the handler (on the loop's thread under `watch`, if given) for `seconds`
        at most; its result as the JSON text (or binary result) to ACK with."""
        query = execution.retrieved.query
        name = query.get("queryHandler")
        set_cancel_handler = self._cancel_handler_setter(execution)
        if name == STREAM_HANDLER:
            return await self._run_stream(execution)

        handler = self.queue.query_handlers.get(str(name))
        if handler is None:
            raise QueryError(f"no query handler {name!r}")
        if inspect.iscoroutinefunction(handler):
            execution.handler_task = asyncio.ensure_future(
                handler(query_of(execution.retrieved, self.queue.codecs), set_cancel_handler)
            )
        elif watch is not None:
            value = self._run_on_loop(watch, execution, handler, set_cancel_handler, seconds)
            if inspect.isawaitable(value):
                value = await value
            return self.queue.codecs.encode_outcome(value)
        else:
            # A sync handler runs in a thread so this loop keeps heartbeating.
            execution.handler_task = self._threads.run(
                functools.partial(
                    self._in_threads.call,
                    handler,
                    query_of(execution.retrieved, self.queue.codecs),
                    set_cancel_handler,
                    key=execution.retrieved.queue_id,
                ),
                within=self.sync_handler_wait,
            )
        try:
            value = await wait_within(execution.handler_task, seconds)
        except TimeoutError:
            execution.handler_task.cancel()
            raise _timeout_error(execution.timeout) from None
        except asyncio.CancelledError:
            if execution.cancelled and execution.handler_task.cancelled():
                raise QueryCancelledError(CANCELLED_MESSAGE) from None
            execution.handler_task.cancel()  # this execution is being stopped (shutdown)
            await asyncio.gather(execution.handler_task, return_exceptions=True)
            raise
        if inspect.isawaitable(value):
            value = await value
        return self.queue.codecs.encode_outcome(value)

    def _cancel_handler_setter(self, execution: Execution) -> SetCancelHandler:
        """The `set_cancel_handler` a handler is given: it records the handler's cancel
        data in the item (from the handler's thread, through the loop)."""
        loop = asyncio.get_running_loop()

        def set_cancel_handler(value: Any) -> None:
            execution.cancel_handler = value
            run, watch = execution.on_loop, self.watch
            if run is not None and watch is not None and watch.carry_cancel_handler(run, value):
                return

            keep = functools.partial(record, self.queue, execution, {"cancelHandler": value})
            if _in_loop(loop):
                keep()
            else:
                loop.call_soon_threadsafe(keep)

        return set_cancel_handler

    def _watch_for(self, name: str) -> LoopRunWatch | None:
        """The watch to run this handler under on the loop's thread (None: not there)."""
        handler = self.queue.query_handlers.get(name)
        if (
            self.watch is None
            or handler is None
            or inspect.iscoroutinefunction(handler)
            or not stoppable_from_a_thread(self.queue, name)
        ):
            return None
        return self.watch

    def _run_on_loop(
        self,
        watch: LoopRunWatch,
        execution: Execution,
        handler: QueryHandler,
        set_cancel_handler: SetCancelHandler,
        seconds: float,
    ) -> Any:
        """Run a sync handler on this (the loop's) thread while `watch` looks on. Stopped
        from the watch's thread, its end, whatever it is, is that stop's error."""
        stop = functools.partial(self._stop_on_loop, execution, asyncio.get_running_loop())
        execution.on_loop = LoopRun(execution.retrieved.queue_id, time.monotonic() + seconds, stop)
        watch.begin(execution.on_loop)
        try:
            value = handler(query_of(execution.retrieved, self.queue.codecs), set_cancel_handler)
        except Exception:
            if execution.stopped is None:
                raise
        finally:
            watch.end()
            execution.on_loop = None
        if execution.stopped is not None:
            raise execution.stopped
        return value

    def _stop_on_loop(
        self, execution: Execution, loop: asyncio.AbstractEventLoop, timed_out: bool
    ) -> Outcome:
        """From the watch's thread: stop a sync handler running on the loop's thread, as
        `process_cancel` (a cancellation) or the execution timeout would stop one running in
        a thread: its cancel handler is called here. The outcome its waiters get."""
        retrieved = execution.retrieved
        context = execution_context(self.queue.prefix, retrieved)
        execution.external_cancel_fired = True  # once: the loop need not notice it again
        self.queue.events.emit(
            ev.CANCELLING_TIMEOUT if timed_out else ev.CANCELLING_EXTERNAL, context
        )
        execution.stopped = (
            _timeout_error(execution.timeout)
            if timed_out
            else QueryCancelledError(CANCELLED_MESSAGE)
        )
        definition = {**retrieved.query, "cancelHandler": execution.cancel_handler}
        cancel_from_a_thread(self.queue, definition, context, loop)
        return encode_error(execution.stopped)

    async def _run_stream(self, execution: Execution) -> str:
        """A stream query: its handler writes rows to a stream its waiters read here."""
        retrieved = execution.retrieved
        query = retrieved.query
        if self.queue.stream_handler is None:
            raise QueryError("no stream_handler for a stream query")
        stream = self.queue.streams.create(retrieved.query_key_hash, query.get("query"))
        task = asyncio.ensure_future(
            self.queue.stream_handler(query_of(execution.retrieved, self.queue.codecs), stream)
        )
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
            self.queue.streams.ended(stream)
        await stream.end()
        return '{"streamResult":true}'

    def close(self) -> None:
        self._threads.close()

    def wait_for_handler_threads(
        self, timeout: float | None = None, queue_id: QueueId | None = None
    ) -> bool:
        """Block until no sync handler runs in a thread (that of `queue_id`, if given);
        False on timeout."""
        return self._in_threads.wait_for_none(timeout, key=queue_id)

    def handler_thread_runs(self, queue_id: QueueId) -> bool:
        """Whether the sync handler of `queue_id` still runs in a thread: stopped (cancelled,
        timed out), it runs on until it returns."""
        return self._in_threads.runs(queue_id)

    @property
    def handler_threads(self) -> int:
        """Sync handlers still running in threads — including ones whose execution was
        cancelled or timed out, which Python cannot stop (a worker process can be)."""
        return self._in_threads.running

    async def _heartbeat(self, execution: Execution, context: dict[str, Any]) -> None:
        retrieved = execution.retrieved
        conn = self.queue.connection
        clock = self.queue.clock
        last_logged = clock.now_ms()
        while True:
            await clock.sleep(self.queue.heartbeat_interval)
            if execution.finished:  # ends even if a cancellation went astray
                return
            if clock.now_ms() - last_logged >= HEARTBEAT_LOG_INTERVAL_MS:
                last_logged = clock.now_ms()
                self.queue.events.emit(ev.HEARTBEAT, context)
            try:
                await conn.update_heartbeat(retrieved.query_key_hash, retrieved.queue_id)
            except Exception as exc:
                self.queue.events.emit(ev.ERROR_UPDATING_HEARTBEAT, {**context, "error": repr(exc)})
            if execution.external_cancel_fired:
                continue
            try:
                current = await conn.get_query_def(retrieved.query_key_hash, retrieved.queue_id)
                if current is None:  # removed by someone else (manual cancel elsewhere, reaped)
                    await self._cancel_external(execution)
            except Exception as exc:
                self.queue.events.emit(ev.ERROR_CHECKING_EXTERNAL, {**context, "error": repr(exc)})

    def cancel_execution(self, queue_id: QueueId) -> bool:
        """The item this process runs was removed elsewhere (a supervisor says so at once):
        stop it now with its cancel handler, as its next heartbeat would. False if it does
        not run here or was stopped already."""
        execution = self.executions.get(queue_id)
        if execution is None or execution.external_cancel_fired or execution.finished:
            return False
        self.queue._spawn(self._cancel_external(execution))
        return True

    async def _cancel_external(self, execution: Execution) -> None:
        if execution.external_cancel_fired:  # once, whoever notices first
            return
        execution.external_cancel_fired = True
        retrieved = execution.retrieved
        self.queue.events.emit(
            ev.CANCELLING_EXTERNAL, execution_context(self.queue.prefix, retrieved)
        )
        await self.process_cancel(
            {**retrieved.query, "cancelHandler": execution.cancel_handler}, retrieved.queue_id
        )

    async def process_cancel(self, query_def: QueryDef, queue_id: QueueId | None) -> None:
        """Call the cancel handler of the query's handler, and stop the query if it runs in
        this process (an async handler stops; a thread can only be abandoned)."""
        execution = self.executions.get(queue_id) if queue_id else None
        await call_cancel_handler(self.queue, query_def, queue_id, execution)


def _timeout_error(seconds: float) -> QueryTimeoutError:
    # In units people read (Cube says "after 0.1333 min of waiting").
    return QueryTimeoutError(
        f"Query execution timeout after {seconds:g} s (execution_timeout {seconds:g} s)"
    )


def _ms_since(started: float) -> int:
    return round((time.monotonic() - started) * 1000)


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _quietly(task: asyncio.Task[Any]) -> None:
    """A task nobody awaits: its outcome is read (and dropped, as gather's
    return_exceptions did), so Python does not report it as never retrieved."""
    if not task.cancelled():
        task.exception()


def record(queue: QueryQueue, execution: Execution, patch: dict[str, Any]) -> None:
    """Merge `patch` into the item's extra, beside the run (a side task: the ACK waits for
    it); a failure is logged, not raised."""
    execution.side_tasks.add(asyncio.ensure_future(_record(queue, execution, patch)))


async def _record(queue: QueryQueue, execution: Execution, patch: dict[str, Any]) -> None:
    retrieved = execution.retrieved
    try:
        await queue.connection.optimistic_query_update(
            retrieved.query_key_hash, patch, retrieved.queue_id
        )
    except Exception as exc:
        queue.events.emit(
            ev.ERROR_QUERY_UPDATE,
            {**execution_context(queue.prefix, retrieved), "error": repr(exc)},
        )
