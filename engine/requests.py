"""The request side of Cube's QueryQueue: enqueue (or join) a query, get it started, wait
for its result. `QueryQueue.execute_in_queue` and `run` are this, one long poll at a time.

    execute: cached result? -> _enqueue (ADD; the fast track is ADD_AND_RETRIEVE)
             -> _start (hand off what the fast track retrieved, else reconcile)
             -> RESULT_BLOCKING
Dedup is the store's: an identical key in flight makes ADD join it (`_joined_context`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from queryqueue.engine import events as ev
from queryqueue.engine.binary import ResultView
from queryqueue.engine.connection import AddedToQueue, QueryDef
from queryqueue.engine.errors import ContinueWaitError, InvalidCommandError, QueueClosedError
from queryqueue.engine.executor import STREAM_HANDLER
from queryqueue.engine.hashing import hash_query_key
from queryqueue.engine.outcome import parse_result
from queryqueue.engine.retrieved import RetrievedQuery
from queryqueue.engine.validation import MAX_EXTERNAL_ID_LENGTH, MAX_PRIORITY, MIN_PRIORITY

if TYPE_CHECKING:
    from queryqueue.engine.queue import QueryQueue

# The fast track is for latency-sensitive work: QueryCache submits user queries at 10.
FAST_TRACK_PRIORITY = 10


@dataclass(frozen=True, slots=True)
class Request:
    """One caller's query, as `execute_in_queue` and `run` take it."""

    query_handler: str
    query_key: Any
    query: Any
    priority: int
    stage_query_key: Any
    request_id: str | None
    span_id: str | None
    view: bool = False  # answer a ResultView
    # Seconds its execution may take, where shorter than its handler's and queue's: the
    # item's, set by the call that enqueues it (a call that joins it does not change it).
    execution_timeout: float | None = None
    # Seconds old a stored result may be and still answer, read before or not (None:
    # only a result nobody has read).
    max_age: float | None = None


class RequestSide:
    def __init__(self, queue: QueryQueue) -> None:
        self.queue = queue

    async def execute(self, request: Request, wait: float) -> Any:
        """One long poll of `wait` seconds for `request`: its result, or ContinueWaitError."""
        self._check(request)
        is_stream = request.query_handler == STREAM_HANDLER
        flags: Mapping[str, Any] = request.query if isinstance(request.query, Mapping) else {}
        query_key_hash = self.queue.hash_query_key(request.query_key, persistent=is_stream)
        external_id = _external_id(request.request_id)
        conn = self.queue.connection
        if flags.get("forceBuild"):
            if await conn.get_query_def(query_key_hash) is not None:
                return None  # a build of this key is already queued or running
        elif external_id is not None or is_stream:
            # Cube's RESULT first. Without an external id (read-many, across paths) and
            # for a plain query, ADD's `if_no_result` answers the same question in the
            # same round trip: an unread result comes back as the item to read.
            found = await conn.get_result(query_key_hash, external_id, view=request.view)
            if found is not None and not (isinstance(found, dict) and found.get("streamResult")):
                return self.answer(found, request.view)
        # Subscribe before anything can dispatch the stream: a handler that starts at once
        # would otherwise emit into no listener.
        stream_waiter = self.queue.streams.subscribe(query_key_hash) if is_stream else None
        waiting: dict[str, Any] | None = None
        try:
            # The long poll that follows, announced with the ADD: a driver may send both
            # in one write (none follows a stream, whose rows come otherwise, or a job).
            then_wait_ms = None if is_stream or flags.get("isJob") else conn.wait_ms(wait)
            added = await self._enqueue(request, query_key_hash, external_id, flags, then_wait_ms)
            waiting = await self._start(request, query_key_hash, added, flags)
            if stream_waiter is not None:
                return await self.queue._wait_for_stream(query_key_hash, stream_waiter)
            if flags.get("isJob"):
                return None
            result = await conn.get_result_blocking(
                query_key_hash, added.queue_id, wait, view=request.view
            )
            if result is None:
                raise ContinueWaitError(queue_id=added.queue_id)
            return self.answer(result, request.view)
        except BaseException:
            if waiting is not None:
                self.queue.events.emit(ev.FINISHED_WAITING, waiting)
            raise
        finally:
            if stream_waiter is not None:
                self.queue.streams.unsubscribe(query_key_hash, stream_waiter)

    def answer(self, outcome: Any, view: bool) -> Any:
        """A decoded outcome's value (a `ResultView` of it for `view`); an error raises."""
        release = outcome.pop("$lease", None) if isinstance(outcome, dict) else None
        try:
            value = parse_result(outcome, self.queue.codecs)
        except BaseException:
            if release is not None:
                self.queue._spawn(release())
            raise
        return ResultView(value, release) if view else value

    def _check(self, request: Request) -> None:
        priority = request.priority
        if (
            not isinstance(priority, int)
            or isinstance(priority, bool)
            or not (MIN_PRIORITY <= priority <= MAX_PRIORITY)
        ):
            raise InvalidCommandError(
                f"Priority should be between {MIN_PRIORITY} and {MAX_PRIORITY}, got {priority!r}"
            )
        for name in ("execution_timeout", "max_age"):
            seconds = getattr(request, name)
            if seconds is not None and (
                not isinstance(seconds, int | float) or isinstance(seconds, bool) or not seconds > 0
            ):
                raise InvalidCommandError(f"{name} must be positive seconds, got {seconds!r}")
        if self.queue._closed:
            raise QueueClosedError(f"the queue {self.queue.prefix!r} is closed")
        if request.query_handler == STREAM_HANDLER:
            if self.queue.stream_handler is None:
                raise InvalidCommandError("a stream query needs a stream_handler")
        elif self.queue.query_handlers and request.query_handler not in self.queue.query_handlers:
            # A queue with no handlers runs nothing itself (a thin client): whoever runs
            # its queries (a supervisor's pool) says whether it knows the handler.
            raise InvalidCommandError(f"unknown query handler {request.query_handler!r}")

    async def _enqueue(
        self,
        request: Request,
        query_key_hash: str,
        external_id: str | None,
        flags: Mapping[str, Any],
        then_wait_ms: int | None,
    ) -> AddedToQueue:
        """ADD, or on the fast track ADD_AND_RETRIEVE; joins an identical query in flight."""
        # Typed values (a date, a Decimal) travel as the result codec writes them, their
        # types beside (`queryTypes`, which Cube's clients never read): the handler gets
        # them back typed.
        query, types = self.queue.codecs.encode_value(request.query, "query")
        query_def: QueryDef = {
            "queryHandler": request.query_handler,
            "query": query,
            "queryKey": self.queue.plain_key(request.query_key),
            "stageQueryKey": request.stage_query_key,
            "priority": request.priority,
            "requestId": request.request_id,
            "addedToQueueTime": self.queue.clock.now_ms(),
        }
        if types is not None:
            query_def["queryTypes"] = types
        if request.execution_timeout is not None:
            query_def["executionTimeout"] = request.execution_timeout
        try:  # the query and its key are JSON now; the stage key is checked here
            orjson.dumps(request.stage_query_key)
        except TypeError as exc:
            raise InvalidCommandError(f"the stage query key must be JSON: {exc}") from None
        is_stream = request.query_handler == STREAM_HANDLER
        reuse = not is_stream and not flags.get("forceBuild")
        return await self.queue.connection.add_to_queue(
            query_key_hash,
            query_def,
            priority=request.priority,
            orphaned_timeout=flags.get("orphanedTimeout", self.queue.orphaned_timeout),
            external_id=external_id,
            exclusive=is_stream,
            fast_track=self.queue.fast_track and request.priority >= FAST_TRACK_PRIORITY,
            # A result that landed since our RESULT read answers: never a second run.
            if_no_result=reuse,
            # A result read already answers too while younger than the call's max age.
            max_age_ms=None if request.max_age is None or not reuse else _ms(request.max_age),
            then_wait_ms=then_wait_ms,
            # The active keys are the "Waiting for query" event's: listed for a listener.
            list_active=self.queue.events.wanted(ev.WAITING_FOR_QUERY),
        )

    async def _start(
        self,
        request: Request,
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
            "queuePrefix": self.queue.prefix,
            "requestId": request.request_id,
            "waitingForRequestId": request.request_id,
        }
        fast_tracked = added.fast_tracked
        if added.added:
            self.queue.events.emit(
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
        if fast_tracked:
            if not added.dispatched:  # else the supervisor's pool has it already
                await self._fast_track(query_key_hash, added, context)
            active_keys, to_process = list(added.active_keys), list[str]()
        else:
            if self.queue.reconcile or request.query_handler == STREAM_HANDLER:
                await self.queue.reconcile_queue()
            if not added.added and self.queue.events.wanted(ev.WAITING_FOR_QUERY):
                # Whose request it joined: a round trip, only for someone who listens.
                context = await self._joined_context(query_key_hash, added, context)
            if self.queue.events.wanted(ev.WAITING_FOR_QUERY):
                active_keys, to_process, _ = await self.queue.connection.get_query_stage_state(True)
            else:  # a listing of the whole queue per request, for nobody: skipped
                active_keys, to_process = [], []
        self.queue.events.emit(
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
            await self.queue.send_process_message_fn(retrieved)
        except Exception as exc:
            # The item is active and ours: only the stalled path can reclaim it now.
            self.queue.events.emit(ev.ERROR_PROCESSING_MESSAGE, {**context, "error": repr(exc)})
            raise ContinueWaitError(queue_id=added.queue_id) from exc

    async def _joined_context(
        self, query_key_hash: str, added: AddedToQueue, context: dict[str, Any]
    ) -> dict[str, Any]:
        """Dedup: an identical query was in flight; the events name whose request it is."""
        existing = await self.queue.connection.get_query_def(query_key_hash, added.queue_id)
        if existing is None:
            return context
        return {
            **context,
            "queryKey": existing.get("queryKey"),
            "waitingForRequestId": existing.get("requestId"),
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


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
