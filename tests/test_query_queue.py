"""QueryQueue on every store: each test checks an observable outcome of the design."""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from queryqueue import (
    ContinueWaitError,
    InvalidCommandError,
    LocalQueueDriver,
    MemoryQueueStore,
    QueryCancelledError,
    QueryError,
    QueryQueue,
    QueryStream,
    QueryTimeoutError,
    QueueClosedError,
    QueueDriver,
    QueueStore,
    RetrievedQuery,
    SocketQueueDriver,
    SqliteQueueStore,
    StoreError,
    SyncQueryQueue,
)
from queryqueue.engine import events as ev
from queryqueue.engine.binary import Outcome
from queryqueue.engine.clock import ManualClock
from queryqueue.engine.outcome import encode_retry
from queryqueue.engine.responses import ListResponse
from tests.recording import record_calls
from tests.supervisor_util import SupervisorProcess, socket_dir, start_supervisor
from tests.waiting import wait_until

PREFIX = "tq"
MakeQueue = Callable[..., QueryQueue]


@pytest.fixture(scope="module")
def supervisor() -> Iterator[SupervisorProcess]:
    """One supervisor process per test module (and xdist worker); stopped by its pid."""
    directory = socket_dir()
    process = start_supervisor(directory / "queue.db", directory / "s.sock")
    try:
        yield process
    finally:
        assert process.stop() == 0
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(params=["memory", "sqlite", "supervisor"])
async def shared_driver(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[QueueDriver]:
    """Every test runs on an in-memory store, a SQLite store, and through a supervisor."""
    if request.param == "supervisor":
        process: SupervisorProcess = request.getfixturevalue("supervisor")
        remote = SocketQueueDriver(process.socket_path, reconnect_timeout=10)
        await remote.truncate()
        yield remote
        await remote.close()
        return
    store: QueueStore = (
        MemoryQueueStore() if request.param == "memory" else SqliteQueueStore(tmp_path / "q.db")
    )
    yield LocalQueueDriver(store)
    store.close()


@pytest.fixture
async def make_queue(shared_driver: QueueDriver) -> AsyncIterator[MakeQueue]:
    made: list[QueryQueue] = []

    def make(**options: Any) -> QueryQueue:
        options.setdefault("query_handlers", {})
        options.setdefault("continue_wait_timeout", 5.0)
        # Long enough that a loaded CI machine never lets a live query look stalled; tests
        # about stalling set a short one.
        options.setdefault("heartbeat_interval", 1.0)
        queue = QueryQueue(PREFIX, driver=shared_driver, **options)
        made.append(queue)
        return queue

    yield make
    for queue in made:
        await queue.shutdown(grace=0)  # stop whatever a test left running, at once


class Recorder:
    """Handlers and cancel handlers that record what happened."""

    def __init__(self) -> None:
        self.calls: list[Any] = []
        self.running = 0
        self.max_running = 0
        self.cancelled: list[dict[str, Any]] = []
        self.gate = asyncio.Event()
        self.events: list[tuple[str, dict[str, Any]]] = []

    async def gated(self, query: Any, set_cancel_handler: Callable[[Any], None]) -> Any:
        self.calls.append(query)
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        set_cancel_handler({"kill": query})
        try:
            await self.gate.wait()
            return {"echo": query}
        finally:
            self.running -= 1

    async def instant(self, query: Any, set_cancel_handler: Callable[[Any], None]) -> Any:
        self.calls.append(query)
        return {"echo": query}

    async def cancel(self, query_def: dict[str, Any]) -> None:
        self.cancelled.append(query_def)

    def log(self, message: str, fields: dict[str, Any]) -> None:
        self.events.append((message, fields))

    def named(self, message: str) -> list[dict[str, Any]]:
        return [fields for name, fields in self.events if name == message]


@pytest.fixture
def rec() -> Recorder:
    return Recorder()


async def test_result_is_returned_and_a_later_call_runs_again(
    make_queue: MakeQueue, rec: Recorder
) -> None:
    queue = make_queue(query_handlers={"sql": rec.instant}, logger=rec.log)
    assert await queue.execute_in_queue("sql", ["SELECT 1", []], {"sql": 1}) == {"echo": {"sql": 1}}
    # The waiter took the result: the queue shares in-flight work, it is not a cache.
    assert await queue.execute_in_queue("sql", ["SELECT 1", []], {"sql": 1}) == {"echo": {"sql": 1}}
    assert len(rec.calls) == 2 and len(rec.named(ev.ADDED_TO_QUEUE)) == 2
    assert await _items(queue) == []


async def test_identical_concurrent_calls_execute_once(
    make_queue: MakeQueue, rec: Recorder
) -> None:
    queue = make_queue(query_handlers={"sql": rec.gated}, cancel_handlers={"sql": rec.cancel})
    callers = [
        asyncio.create_task(queue.execute_in_queue("sql", "same-key", {"n": 1})) for _ in range(12)
    ]
    # every caller has joined the one item and is parked on its result (a long poll may
    # park with its ADD, before the reconcile starts the item), and the item runs once
    await wait_until(lambda: _waiting(queue, 12))
    await wait_until(lambda: rec.calls, what="the one item running")
    assert len(rec.calls) == 1
    rec.gate.set()
    results = await asyncio.gather(*callers)
    assert results == [{"echo": {"n": 1}}] * 12
    assert len(rec.calls) == 1


async def test_handler_errors_reach_every_waiter(make_queue: MakeQueue, rec: Recorder) -> None:
    started = asyncio.Event()
    release = asyncio.Event()

    async def failing(query: Any, _: Any) -> Any:
        started.set()
        await release.wait()
        raise RuntimeError("relation does not exist")

    queue = make_queue(query_handlers={"sql": failing})
    callers = [asyncio.create_task(queue.execute_in_queue("sql", "bad", {})) for _ in range(3)]
    await started.wait()
    release.set()
    outcomes = await asyncio.gather(*callers, return_exceptions=True)
    assert [type(o) for o in outcomes] == [QueryError] * 3
    assert all(str(o) == "relation does not exist" for o in outcomes)


async def test_priority_order_then_fifo(make_queue: MakeQueue, rec: Recorder) -> None:
    order: list[str] = []
    blocker_release = asyncio.Event()

    async def handler(query: Any, _: Any) -> Any:
        if query == "blocker":
            await blocker_release.wait()
        order.append(query)
        return query

    queue = make_queue(query_handlers={"sql": handler}, concurrency=1)
    blocker = asyncio.create_task(queue.execute_in_queue("sql", "blocker", "blocker"))
    await wait_until(lambda: _active(queue))
    waiting = []
    for name, priority in [("low-1", 0), ("high-1", 5), ("low-2", 0), ("high-2", 5), ("urgent", 9)]:
        waiting.append(asyncio.create_task(queue.execute_in_queue("sql", name, name, priority)))
        await _wait_pending(queue, len(waiting))
    blocker_release.set()
    await asyncio.gather(blocker, *waiting)
    assert order == ["blocker", "urgent", "high-1", "high-2", "low-1", "low-2"]


async def _wait_pending(queue: QueryQueue, count: int) -> None:
    await wait_until(lambda: _pending_count(queue, count))


async def _active(queue: QueryQueue) -> bool:
    return bool(await queue.driver.active(PREFIX))


async def _pending_count(queue: QueryQueue, expected: int) -> bool:
    return len(await queue.driver.pending(PREFIX)) == expected


async def _owned_pending(queue: QueryQueue) -> bool:
    return len(await queue.driver.pending(PREFIX, process_id=queue.process_uid)) == 1


async def _items(queue: QueryQueue) -> list[ListResponse]:
    return await queue.driver.list_items(PREFIX, process_id=queue.process_uid)


async def _statuses(queue: QueryQueue) -> list[str]:
    return [row.status for row in await _items(queue)]


async def _has_statuses(queue: QueryQueue, statuses: list[str]) -> bool:
    return await _statuses(queue) == statuses


async def _waiting(queue: QueryQueue, count: int) -> bool:
    return bool((await queue.driver.stats())["waiters"] == count)


async def _empty(queue: QueryQueue) -> bool:
    return not await _items(queue)


async def test_concurrency_is_never_exceeded(make_queue: MakeQueue, rec: Recorder) -> None:
    queue = make_queue(query_handlers={"sql": rec.gated}, concurrency=3)
    callers = [
        asyncio.create_task(queue.execute_in_queue("sql", f"q{i}", i, 10 if i % 2 else 0))
        for i in range(15)
    ]
    await wait_until(lambda: rec.running == 3)
    rec.gate.set()
    results = await asyncio.gather(*callers)
    assert sorted(r["echo"] for r in results) == list(range(15))
    assert rec.max_running == 3


async def test_continue_wait_then_result_on_retry(make_queue: MakeQueue, rec: Recorder) -> None:
    queue = make_queue(
        query_handlers={"sql": rec.gated}, continue_wait_timeout=0.05, logger=rec.log
    )
    with pytest.raises(ContinueWaitError, match="Continue wait"):
        await queue.execute_in_queue("sql", "slow", {"q": 1})
    assert rec.named(ev.FINISHED_WAITING)
    with pytest.raises(ContinueWaitError):
        await queue.execute_in_queue("sql", "slow", {"q": 1})  # joins the same item
    rec.gate.set()
    await wait_until(lambda: _empty(queue))
    assert await queue.execute_in_queue("sql", "slow", {"q": 1}) == {"echo": {"q": 1}}
    assert len(rec.calls) == 1


async def test_is_job_returns_at_once_and_runs(make_queue: MakeQueue, rec: Recorder) -> None:
    queue = make_queue(query_handlers={"sql": rec.gated})
    assert await queue.execute_in_queue("sql", "job", {"isJob": True}) is None
    await wait_until(lambda: len(rec.calls) == 1)
    rec.gate.set()
    await wait_until(lambda: _empty(queue))


async def test_force_build_skips_the_cached_result_and_joins_a_running_build(
    make_queue: MakeQueue, rec: Recorder
) -> None:
    queue = make_queue(query_handlers={"sql": rec.gated})
    rec.gate.set()
    assert await queue.execute_in_queue("sql", "k", {"v": 1}) == {"echo": {"v": 1}}
    rec.gate.clear()
    build = asyncio.create_task(queue.execute_in_queue("sql", "k", {"forceBuild": True}))
    await wait_until(lambda: len(rec.calls) == 2)
    # a build of the key is already queued: a second forced build returns None at once
    assert await queue.execute_in_queue("sql", "k", {"forceBuild": True}) is None
    rec.gate.set()
    assert await build == {"echo": {"forceBuild": True}}


async def test_bad_input_is_refused_before_anything_is_enqueued(
    make_queue: MakeQueue, rec: Recorder
) -> None:
    queue = make_queue(query_handlers={"sql": rec.instant})
    with pytest.raises(ValueError, match="Priority should be between -10000 and 10000"):
        await queue.execute_in_queue("sql", "k", {}, 10001)
    with pytest.raises(ValueError, match="unknown query handler 'nope'"):
        await queue.execute_in_queue("nope", "k", {})
    with pytest.raises(
        ValueError, match=r"the query holds a builtins.object at query\[.x.\], which has no codec"
    ):
        await queue.execute_in_queue("sql", "k", {"x": object()})
    with pytest.raises(ValueError, match="stream_handler"):
        await queue.execute_in_queue("stream", "k", {})
    assert await _items(queue) == []
    assert rec.calls == []


async def test_execution_timeout_errors_waiters_and_calls_cancel_handler(
    make_queue: MakeQueue, rec: Recorder
) -> None:
    queue = make_queue(
        query_handlers={"sql": rec.gated},
        cancel_handlers={"sql": rec.cancel},
        execution_timeout=0.2,
        logger=rec.log,
    )
    with pytest.raises(
        QueryError, match=r"Query execution timeout after 0\.2 s \(execution_timeout 0\.2 s\)"
    ):
        await queue.execute_in_queue("sql", "forever", {"q": "forever"})
    assert [c["cancelHandler"] for c in rec.cancelled] == [{"kill": {"q": "forever"}}]
    assert rec.named(ev.CANCELLING_TIMEOUT)
    assert rec.running == 0  # the async handler was stopped, not abandoned


async def test_orphaned_item_is_reaped_while_polled_item_survives(
    make_queue: MakeQueue, rec: Recorder
) -> None:
    queue = make_queue(
        query_handlers={"sql": rec.gated},
        cancel_handlers={"sql": rec.cancel},
        concurrency=1,
        continue_wait_timeout=0.05,
        orphaned_timeout=0.4,
        logger=rec.log,
    )
    blocker = asyncio.create_task(queue.execute_in_queue("sql", "blocker", "blocker", 0))
    await wait_until(lambda: rec.running == 1)
    for name in ("abandoned", "polled"):
        with pytest.raises(ContinueWaitError):
            await queue.execute_in_queue("sql", name, name)
    deadline = time.monotonic() + 10
    while not rec.cancelled:
        assert time.monotonic() < deadline, "orphaned item never reaped"
        with pytest.raises(ContinueWaitError):
            await queue.execute_in_queue("sql", "polled", "polled")  # re-ADD keeps it alive
    assert [c["query"] for c in rec.cancelled] == ["abandoned"]
    assert rec.named(ev.REMOVING_ORPHANED)
    assert [row.id for row in await queue.driver.pending(PREFIX)] == [
        queue.hash_query_key("polled")
    ]
    rec.gate.set()
    await asyncio.gather(blocker, return_exceptions=True)  # its caller stopped waiting long ago
    assert await _retry(queue, "polled") == {"echo": "polled"}
    assert "abandoned" not in rec.calls


async def _retry(queue: QueryQueue, key: str, query: Any = None, within: float = 10.0) -> Any:
    deadline = time.monotonic() + within
    while True:
        try:
            return await queue.execute_in_queue("sql", key, key if query is None else query)
        except ContinueWaitError:
            assert time.monotonic() < deadline, "no result in time"


async def test_stalled_item_is_reaped_and_retry_executes_afresh(
    make_queue: MakeQueue, rec: Recorder
) -> None:
    lost: list[RetrievedQuery] = []

    async def losing_hand_off(retrieved: RetrievedQuery) -> None:
        lost.append(retrieved)  # a worker that died with the message: nobody heartbeats

    dead = make_queue(
        query_handlers={"sql": rec.instant},
        cancel_handlers={"sql": rec.cancel},
        send_process_message_fn=losing_hand_off,
        continue_wait_timeout=0.05,
    )
    with pytest.raises(ContinueWaitError):
        await dead.execute_in_queue("sql", "stalls", "stalls")
    assert len(lost) == 1 and await _statuses(dead) == ["active"]

    alive = make_queue(
        query_handlers={"sql": rec.instant},
        cancel_handlers={"sql": rec.cancel},
        continue_wait_timeout=0.05,
        heartbeat_interval=0.05,  # stalled after 0.2 s without a heartbeat
        logger=rec.log,
    )

    async def reaped() -> bool:  # reconcile is what reaps
        await alive.reconcile_queue()
        return bool(rec.cancelled)

    await wait_until(reaped, what="the stalled item reaped")
    assert [c["query"] for c in rec.cancelled] == ["stalls"]
    assert await _retry(alive, "stalls") == {"echo": "stalls"}
    assert rec.calls == ["stalls"]


async def test_sync_handler_keeps_heartbeating_while_it_blocks(
    make_queue: MakeQueue, rec: Recorder
) -> None:
    release = threading.Event()

    def blocking(query: Any, set_cancel_handler: Callable[[Any], None]) -> Any:
        set_cancel_handler("pid-1")
        assert release.wait(30)
        return "done"

    queue = make_queue(
        query_handlers={"sql": blocking},
        cancel_handlers={"sql": rec.cancel},
        heartbeat_interval=0.1,  # stalled after 0.4 s without a heartbeat
    )
    beats = 0
    heartbeat = queue.driver.heartbeat

    async def counted(key: Any) -> bool:
        nonlocal beats
        beats += 1
        return await heartbeat(key)

    queue.driver.heartbeat = counted  # type: ignore[method-assign]
    caller = asyncio.create_task(queue.execute_in_queue("sql", "blocking", {}))
    await wait_until(lambda: _active(queue))

    async def beaten_through_three_timeouts() -> bool:
        await queue.reconcile_queue()  # what would reap it, were it stalled
        return beats >= 12

    await wait_until(beaten_through_three_timeouts, what="twelve heartbeats")
    assert rec.cancelled == []
    defs = await _items(queue)
    assert defs and '"cancelHandler":"pid-1"' in (defs[0].extra or "")
    release.set()
    assert await caller == "done"


async def test_manual_cancel_calls_cancel_handler_and_stops_the_query(
    make_queue: MakeQueue, rec: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    queue = make_queue(
        query_handlers={"sql": rec.gated},
        cancel_handlers={"sql": rec.cancel},
        continue_wait_timeout=0.3,
        logger=rec.log,
    )
    caller = asyncio.create_task(queue.execute_in_queue("sql", "to-cancel", "to-cancel"))
    await wait_until(lambda: rec.running == 1)
    assert await queue.cancel_query(queue.hash_query_key("to-cancel"))
    await wait_until(lambda: rec.running == 0 and len(rec.cancelled) == 1)
    assert rec.cancelled[0]["query"] == "to-cancel"
    assert rec.named(ev.CANCELLING_MANUAL)
    await wait_until(lambda: rec.named(ev.QUERY_CANCELLED))
    # A deliberate cancel is no error: nothing at ERROR, no traceback to alert on.
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    # The waiter learns of the cancellation: no continue-wait whose retry would run it again.
    with pytest.raises(QueryCancelledError, match="cancelled"):
        await caller
    assert await _items(queue) == []
    assert len(rec.calls) == 1
    rec.gate.set()
    assert await _retry(queue, "to-cancel") == {"echo": "to-cancel"}
    assert len(rec.calls) == 2


async def test_cancel_by_request_id(make_queue: MakeQueue, rec: Recorder) -> None:
    queue = make_queue(
        query_handlers={"sql": rec.gated}, cancel_handlers={"sql": rec.cancel}, concurrency=1
    )
    running = asyncio.create_task(
        queue.execute_in_queue("sql", "a", "a", request_id="req-1-span-1")
    )
    await wait_until(lambda: rec.running == 1)
    queued = asyncio.create_task(queue.execute_in_queue("sql", "b", "b", request_id="req-2"))
    await _wait_pending(queue, 1)
    cancelled = await queue.cancel_query_by_request_id("req-2")
    assert [c["query"] for c in cancelled] == ["b"]
    assert await _statuses(queue) == ["active"]
    rec.gate.set()
    assert await running == {"echo": "a"}
    queued.cancel()
    await asyncio.gather(queued, return_exceptions=True)


async def test_external_cancellation_is_noticed_once_on_the_heartbeat(
    make_queue: MakeQueue, rec: Recorder
) -> None:
    runner = make_queue(
        query_handlers={"sql": rec.gated},
        cancel_handlers={"sql": rec.cancel},
        logger=rec.log,
        heartbeat_interval=0.03,
    )
    other_process = make_queue(query_handlers={}, cancel_handlers={})
    caller = asyncio.create_task(runner.execute_in_queue("sql", "ext", "ext"))
    await wait_until(lambda: rec.running == 1)
    # Removed by someone else: the runner learns only through its heartbeat.
    assert (
        await other_process.connection.get_query_and_remove(runner.hash_query_key("ext"), None)
        is not None
    )
    await wait_until(lambda: len(rec.named(ev.CANCELLING_EXTERNAL)) == 1)
    await wait_until(lambda: rec.running == 0)
    # The execution ends (its heartbeat with it) without firing the cancellation again.
    await wait_until(lambda: not runner.executor.executions)
    assert len(rec.cancelled) == 1 and rec.cancelled[0]["cancelHandler"] == {"kill": "ext"}
    assert len(rec.named(ev.CANCELLING_EXTERNAL)) == 1
    caller.cancel()
    await asyncio.gather(caller, return_exceptions=True)


async def test_reconcile_is_single_flight_with_one_extra_run(make_queue: MakeQueue) -> None:
    queue = make_queue()
    entered = asyncio.Event()
    release = asyncio.Event()
    runs = 0
    original = queue.reconciler.once

    async def slow_impl() -> None:
        nonlocal runs
        runs += 1
        entered.set()
        await release.wait()
        await original()

    queue.reconciler.once = slow_impl  # type: ignore[method-assign]
    first = asyncio.create_task(queue.reconcile_queue())
    await entered.wait()
    others = [asyncio.create_task(queue.reconcile_queue()) for _ in range(10)]
    await asyncio.sleep(0)  # a loop turn (no time passes): the ten calls are made
    assert runs == 1
    release.set()
    await asyncio.gather(first, *others)
    assert runs == 2
    await queue.reconcile_queue()
    assert runs == 3


async def test_persistent_keys_of_another_process_are_never_picked(
    make_queue: MakeQueue, rec: Recorder, shared_driver: QueueDriver
) -> None:
    owner_streams: list[str] = []

    async def stream_handler(query: Any, stream: QueryStream) -> None:
        owner_streams.append(query)
        await stream.write({"row": 1})

    stranger = make_queue(
        query_handlers={"sql": rec.instant}, process_uid="22222222-2222-4222-8222-222222222222"
    )
    owner = make_queue(
        query_handlers={},
        stream_handler=stream_handler,
        process_uid="11111111-1111-4111-8111-111111111111",
    )
    persistent = owner.hash_query_key("stream-key", persistent=True)
    assert persistent.endswith("@11111111-1111-4111-8111-111111111111")
    await shared_driver.add(
        f"{PREFIX}:{persistent}",
        '{"queryHandler":"stream","query":"s","queryKey":"stream-key","addedToQueueTime":0}',
        exclusive=True,
        process_id=owner.process_uid,
    )
    picked: list[str] = []
    original = stranger.process_query

    async def spy(query_key_hash: str, queue_id: int | None = None) -> None:
        picked.append(query_key_hash)
        await original(query_key_hash, queue_id)

    stranger.process_query = spy  # type: ignore[method-assign]
    for _ in range(3):
        await stranger.reconcile_queue()
    assert picked == []
    assert await _statuses(owner) == ["pending"]
    await owner.reconcile_queue()
    await wait_until(lambda: owner_streams == ["s"])


async def test_fast_track_only_at_priority_10_and_while_budget_is_free(
    make_queue: MakeQueue, rec: Recorder
) -> None:
    queue = make_queue(query_handlers={"sql": rec.gated}, concurrency=3, logger=rec.log)
    low = asyncio.create_task(queue.execute_in_queue("sql", "low", "low", 9))
    await wait_until(lambda: rec.running == 1)
    assert [e["fastTrack"] for e in rec.named(ev.ADDED_TO_QUEUE)] == [False]
    burst = [asyncio.create_task(queue.execute_in_queue("sql", f"hi{i}", i, 10)) for i in range(6)]
    await wait_until(lambda: len(rec.named(ev.ADDED_TO_QUEUE)) == 7)
    flags = [e["fastTrack"] for e in rec.named(ev.ADDED_TO_QUEUE)[1:]]
    assert flags.count(True) == 2  # one slot is taken by the low-priority query
    fast = [e for e in rec.named(ev.WAITING_FOR_QUERY) if e["fastTrack"]]
    assert len(fast) == 2 and all(e["active"] for e in fast)
    rec.gate.set()
    await asyncio.gather(low, *burst)


async def test_burst_onto_idle_queue_fast_tracks_exactly_concurrency(
    make_queue: MakeQueue, rec: Recorder
) -> None:
    queue = make_queue(query_handlers={"sql": rec.gated}, concurrency=3, logger=rec.log)
    burst = [asyncio.create_task(queue.execute_in_queue("sql", f"b{i}", i, 10)) for i in range(8)]
    await wait_until(lambda: len(rec.named(ev.ADDED_TO_QUEUE)) == 8)
    assert sorted(e["fastTrack"] for e in rec.named(ev.ADDED_TO_QUEUE)) == [False] * 5 + [True] * 3
    fast_sizes = [e["queueSize"] for e in rec.named(ev.ADDED_TO_QUEUE) if e["fastTrack"]]
    assert fast_sizes == [0, 0, 0]  # a retrieved item never becomes pending
    await wait_until(lambda: rec.running == 3)
    rec.gate.set()
    assert sorted(r["echo"] for r in await asyncio.gather(*burst)) == list(range(8))
    assert rec.max_running == 3


async def test_failed_fast_track_dispatch_is_a_continue_wait(
    make_queue: MakeQueue, rec: Recorder
) -> None:
    async def broken(retrieved: RetrievedQuery) -> None:
        raise ConnectionError("worker pool unreachable")

    queue = make_queue(
        query_handlers={"sql": rec.instant}, send_process_message_fn=broken, logger=rec.log
    )
    with pytest.raises(ContinueWaitError):
        await queue.execute_in_queue("sql", "urgent", "urgent", 10)
    assert "worker pool unreachable" in rec.named(ev.ERROR_PROCESSING_MESSAGE)[0]["error"]
    assert await _statuses(queue) == ["active"]


async def test_stream_that_starts_at_once_reaches_its_waiter(make_queue: MakeQueue) -> None:
    async def stream_handler(query: Any, stream: QueryStream) -> None:
        for i in range(query["rows"]):
            await stream.write({"alias_n": i})

    queue = make_queue(stream_handler=stream_handler)
    stream = await queue.execute_in_queue(
        "stream", ["SELECT n", []], {"rows": 50, "aliasNameToMember": {"alias_n": "n"}}
    )
    assert isinstance(stream, QueryStream)
    assert await stream.rows() == [{"n": i} for i in range(50)]
    await wait_until(lambda: _empty(queue))


async def test_stream_waiter_subscribes_before_dispatch(make_queue: MakeQueue) -> None:
    sequence: list[str] = []

    async def stream_handler(query: Any, stream: QueryStream) -> None:
        await stream.write(1)

    queue = make_queue(stream_handler=stream_handler)
    subscribe = queue.streams.subscribe
    dispatch = queue.send_process_message_fn

    def spy_subscribe(query_key_hash: str) -> asyncio.Future[QueryStream]:
        sequence.append("subscribe")
        return subscribe(query_key_hash)

    async def spy_dispatch(retrieved: RetrievedQuery) -> None:
        sequence.append("dispatch")
        await dispatch(retrieved)

    queue.streams.subscribe = spy_subscribe  # type: ignore[method-assign]
    queue.send_process_message_fn = spy_dispatch
    for priority in (0, 10):  # through reconcile and on the fast track
        sequence.clear()
        stream = await queue.execute_in_queue("stream", f"s{priority}", {}, priority)
        assert await stream.rows() == [1]
        assert sequence == ["subscribe", "dispatch"]


async def test_get_query_stage_reports_executing_and_position(
    make_queue: MakeQueue, rec: Recorder
) -> None:
    queue = make_queue(query_handlers={"sql": rec.gated}, concurrency=1)
    calls = [
        asyncio.create_task(
            queue.execute_in_queue("sql", name, name, stage_query_key=f"stage-{name}")
        )
        for name in ("first", "second", "third")
    ]
    await wait_until(lambda: rec.running == 1)
    await _wait_pending(queue, 2)
    executing = await queue.get_query_stage("stage-first")
    assert executing is not None and executing["stage"] == "Executing query"
    assert executing["timeElapsed"] is not None and executing["timeElapsed"] >= 0
    assert await queue.get_query_stage("stage-third") == {"stage": "#2 in queue"}
    assert await queue.get_query_stage("stage-unknown") is None
    queries = await queue.get_queries()
    assert sorted((q["query"], q["status"]) for q in queries) == [
        ("first", ["active"]),
        ("second", ["toProcess"]),
        ("third", ["toProcess"]),
    ]
    # Cube's entries name the hash as `queryKey`: the idiom below cancels that query.
    third = next(q for q in queries if q["query"] == "third")
    assert third["queryKey"] == queue.hash_query_key("third")
    assert await queue.cancel_query(third["queryKey"]) is True
    with pytest.raises(QueryCancelledError):
        await calls[2]
    rec.gate.set()
    await asyncio.gather(*calls[:2])


async def test_events_reach_python_logging(
    make_queue: MakeQueue, rec: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    queue = make_queue(query_handlers={"sql": rec.instant})
    with caplog.at_level("DEBUG", logger="queryqueue.queue"):
        await queue.execute_in_queue("sql", "logged", {})
    messages = [r.queue_event for r in caplog.records if hasattr(r, "queue_event")]
    assert messages[0] == ev.ADDED_TO_QUEUE
    assert {ev.WAITING_FOR_QUERY, ev.PERFORMING_QUERY, ev.PERFORMING_COMPLETED} <= set(messages)


def test_sync_face(tmp_path: Path) -> None:
    executed: list[Any] = []

    def handler(query: Any, _: Any) -> Any:
        executed.append(query)
        return query * 2

    with SyncQueryQueue(
        "sync", query_handlers={"sql": handler}, driver=SqliteQueueStore(tmp_path / "q.db")
    ) as q:
        assert q.execute_in_queue("sql", "k", 21) == 42
        assert q.execute_in_queue("sql", "k2", 1, 10) == 2
        with pytest.raises(InvalidCommandError):
            q.execute_in_queue("sql", "k", 1, -20000)
    assert executed == [21, 1]


async def test_shutdown_lets_running_queries_finish_within_grace(
    make_queue: MakeQueue, rec: Recorder
) -> None:
    queue = make_queue(query_handlers={"sql": rec.gated})
    caller = asyncio.create_task(queue.execute_in_queue("sql", "k", "k"))
    await wait_until(lambda: rec.running == 1)
    closing = asyncio.create_task(queue.shutdown(grace=30))
    await wait_until(lambda: queue.closing)
    assert not closing.done()
    rec.gate.set()
    await asyncio.wait_for(closing, 10)
    assert await caller == {"echo": "k"}  # it finished and acked
    assert await _items(queue) == []


async def test_shutdown_stops_what_outlives_the_grace(make_queue: MakeQueue, rec: Recorder) -> None:
    queue = make_queue(query_handlers={"sql": rec.gated})
    caller = asyncio.create_task(queue.execute_in_queue("sql", "k", "k"))
    await wait_until(lambda: rec.running == 1)
    await asyncio.wait_for(queue.shutdown(grace=0.1), 10)
    assert rec.running == 0
    assert await _statuses(queue) == ["active"]  # left for the stalled path to reclaim
    caller.cancel()
    await asyncio.gather(caller, return_exceptions=True)


async def test_a_waiting_stream_owner_retrieves_its_item_once_a_slot_frees(
    make_queue: MakeQueue, rec: Recorder
) -> None:
    async def stream_handler(query: Any, stream: QueryStream) -> None:
        await stream.write("row")

    other = make_queue(query_handlers={"sql": rec.gated}, concurrency=1)
    owner = make_queue(stream_handler=stream_handler, concurrency=1, continue_wait_timeout=0.2)
    busy = asyncio.create_task(other.execute_in_queue("sql", "busy", "busy"))
    await wait_until(lambda: rec.running == 1)
    waiting = asyncio.create_task(owner.execute_in_queue("stream", "mine", {}))
    await wait_until(lambda: _has_statuses(owner, ["active", "pending"]))  # no slot: it waits
    rec.gate.set()
    await busy  # the other process's ACK and reconcile cannot take the owner's item...
    stream = await asyncio.wait_for(waiting, 10)  # ...the owner, still waiting, does
    assert await stream.rows() == ["row"]


# -- run(): the call that waits; cancellation and errors callers can see ---------------------


async def test_run_waits_across_long_polls_for_the_same_item(
    make_queue: MakeQueue, rec: Recorder
) -> None:
    queue = make_queue(
        query_handlers={"sql": rec.gated}, continue_wait_timeout=0.05, logger=rec.log
    )
    caller = asyncio.create_task(queue.run("sql", "slow", "slow"))
    # Three long polls end while it runs; run() polls again instead of raising.
    await wait_until(lambda: len(rec.named(ev.WAITING_FOR_QUERY)) >= 3)
    assert not caller.done()
    rec.gate.set()
    assert await caller == {"echo": "slow"}
    assert rec.calls == ["slow"]
    assert len({fields["queueId"] for fields in rec.named(ev.WAITING_FOR_QUERY)}) == 1
    assert await _items(queue) == []


async def test_run_asks_again_when_its_item_got_a_retry_outcome_between_two_polls(
    make_queue: MakeQueue, rec: Recorder, shared_driver: QueueDriver
) -> None:
    """A worker that dies between two of run()'s polls leaves a retry outcome, which
    run() reads by queue id before it polls again: that is a continue-wait too (it
    escaped run() as ContinueWaitError), and run() enqueues the query anew."""
    queue = make_queue(
        query_handlers={"sql": rec.gated}, continue_wait_timeout=0.05, logger=rec.log
    )
    read_by_id = queue.connection.get_result_by_id
    retried: list[Any] = []

    async def worker_died_first(queue_id: Any, *, view: bool = False) -> Any:
        if not retried:  # the first read between polls: the item's worker died just now
            retried.append(queue_id)
            await shared_driver.cancel(queue_id, result=encode_retry("its worker died"))
        return await read_by_id(queue_id, view=view)

    queue.connection.get_result_by_id = worker_died_first  # type: ignore[method-assign]
    caller = asyncio.create_task(queue.run("sql", "dies", "dies"))
    await wait_until(lambda: len(rec.calls) == 2)  # enqueued anew, and run again
    rec.gate.set()
    assert await caller == {"echo": "dies"}
    assert retried and rec.calls == ["dies", "dies"]


async def test_run_raises_query_timeout_at_the_callers_deadline_and_the_query_goes_on(
    make_queue: MakeQueue, rec: Recorder
) -> None:
    queue = make_queue(query_handlers={"sql": rec.gated}, continue_wait_timeout=5.0)
    with pytest.raises(QueryTimeoutError, match=r"within 0\.2 s"):
        await queue.run("sql", "late", "late", timeout=0.2)
    assert rec.running == 1  # still running, for whoever else waits for it
    rec.gate.set()
    await wait_until(lambda: _no_items(queue), what="the execution acknowledged")
    # Its result waited for the next caller: nobody took it when the deadline passed.
    assert await queue.run("sql", "late", "late") == {"echo": "late"}
    assert rec.calls == ["late"]
    with pytest.raises(InvalidCommandError, match="timeout must be positive"):
        await queue.run("sql", "late", "late", timeout=0)


async def _no_items(queue: QueryQueue) -> bool:
    return await _items(queue) == []


async def test_every_waiter_of_a_cancelled_query_gets_query_cancelled(
    make_queue: MakeQueue, rec: Recorder
) -> None:
    queue = make_queue(
        query_handlers={"sql": rec.gated},
        cancel_handlers={"sql": rec.cancel},
        continue_wait_timeout=0.1,
    )
    waiters = [asyncio.create_task(queue.run("sql", "doomed", "doomed")) for _ in range(3)]
    await wait_until(lambda: rec.running == 1)
    assert await queue.cancel_query(queue.hash_query_key("doomed")) is True
    outcomes = await asyncio.gather(*waiters, return_exceptions=True)
    assert [type(o) for o in outcomes] == [QueryCancelledError] * 3
    assert rec.calls == ["doomed"]  # nobody's retry ran it again
    await wait_until(lambda: rec.running == 0 and len(rec.cancelled) == 1)
    # Nothing left to cancel: said so.
    assert await queue.cancel_query(queue.hash_query_key("doomed")) is False


async def test_a_handler_error_reaches_the_caller_with_its_type_and_traceback(
    make_queue: MakeQueue,
) -> None:
    async def broken(query: Any, set_cancel_handler: Any) -> Any:
        return {"ratio": 1 / query}

    queue = make_queue(query_handlers={"sql": broken})
    with pytest.raises(QueryError) as raised:
        await queue.run("sql", "zero", 0)
    assert type(raised.value) is QueryError
    assert str(raised.value) == "division by zero"
    assert raised.value.error_type == "ZeroDivisionError"
    assert raised.value.remote_traceback is not None
    assert "in broken" in raised.value.remote_traceback
    assert "ZeroDivisionError: division by zero" in raised.value.remote_traceback


async def test_shutdown_keeps_the_queue_usable_and_close_refuses_new_work(
    make_queue: MakeQueue, rec: Recorder
) -> None:
    queue = make_queue(query_handlers={"sql": rec.instant}, fast_track=False)
    await queue.shutdown()
    # As in Cube: after shutdown the queue still reconciles, so queued work runs.
    assert await queue.run("sql", "after", "after") == {"echo": "after"}
    await queue.close()
    with pytest.raises(QueueClosedError, match="closed"):
        await queue.run("sql", "later", "later")
    assert rec.calls == ["after"]


async def test_reconcile_calls_made_before_the_run_started_still_cause_one_more(
    make_queue: MakeQueue,
) -> None:
    queue = make_queue()
    runs = 0
    original = queue.reconciler.once

    async def counted() -> None:
        nonlocal runs
        runs += 1
        await original()

    queue.reconciler.once = counted  # type: ignore[method-assign]
    # Ten calls in one loop turn: the first creates the run, the other nine arrive before
    # it has started. Cube: exactly one more run, not none.
    await asyncio.gather(*(queue.reconcile_queue() for _ in range(10)))
    assert runs == 2


async def test_a_stream_owner_is_nudged_when_a_slot_frees_not_a_long_poll_later(
    make_queue: MakeQueue, rec: Recorder
) -> None:
    other = make_queue(query_handlers={"sql": rec.gated}, concurrency=1)
    rows: list[int] = []

    async def stream_rows(query: Any, stream: QueryStream) -> None:
        for i in range(3):
            await stream.write(i)

    # A 30 s long poll: only a nudge can start the stream within the wait below.
    owner = make_queue(
        query_handlers={}, stream_handler=stream_rows, concurrency=1, continue_wait_timeout=30
    )
    busy = asyncio.create_task(other.execute_in_queue("sql", "busy", "busy"))
    await wait_until(lambda: rec.running == 1)
    asking = asyncio.create_task(owner.execute_in_queue("stream", "mine", {}))
    # Behind the budget; nobody but its owner may retrieve it.
    await wait_until(lambda: _owned_pending(owner))
    rec.gate.set()
    stream = await asyncio.wait_for(asking, 10)
    rows = await stream.rows()
    assert rows == [0, 1, 2]
    assert await busy == {"echo": "busy"}


def _on_a_manual_clock(
    rec: Recorder,
    prefix: str,
    handler: Any,
    driver: Callable[[QueueStore], Any] = lambda store: store,
    **options: Any,
) -> tuple[ManualClock, MemoryQueueStore, QueryQueue]:
    """A queue whose store and heartbeats run on one injected clock (heartbeat every 10 s,
    stalled 40 s after the last), its events and cancellations recorded by `rec`."""
    clock = ManualClock()
    store = MemoryQueueStore(clock=clock)
    queue = QueryQueue(
        prefix,
        query_handlers={"sql": handler},
        cancel_handlers={"sql": rec.cancel},
        driver=driver(store),
        clock=clock,
        heartbeat_interval=10.0,
        logger=rec.log,
        **options,
    )
    return clock, store, queue


async def test_the_heartbeat_is_stepped_by_the_injected_clock(rec: Recorder) -> None:
    clock, store, queue = _on_a_manual_clock(rec, "hb", rec.gated)
    caller = asyncio.create_task(queue.execute_in_queue("sql", "beaten", "beaten"))
    try:
        await wait_until(lambda: rec.running == 1 and clock.sleepers == 1)
        assert store.stalled(5_000, "hb") == []
        clock.advance(10_000)  # one heartbeat period, with no real time passing
        # Beaten at the new time: not stalled for 5 s although 10 s passed since it began.
        await wait_until(lambda: clock.sleepers == 1 and store.stalled(5_000, "hb") == [])
        # Removed by someone else: the next stepped beat notices and cancels it here.
        store.cancel(store.active("hb")[0].queue_id)
        clock.advance(10_000)
        await wait_until(lambda: len(rec.cancelled) == 1 and rec.running == 0)
        assert rec.cancelled[0]["cancelHandler"] == {"kill": "beaten"}
    finally:
        caller.cancel()
        await asyncio.gather(caller, return_exceptions=True)
        await queue.close(grace=0)


async def test_the_ack_does_not_wait_for_a_heartbeat_still_in_flight(rec: Recorder) -> None:
    """The handler is done while a heartbeat's round trip is still out (a slow store):
    its ACK goes at once. The heartbeat is cancelled, not waited for: at a sleep it sends
    nothing more, and one in flight went out before the ACK either way."""
    clock = ManualClock()
    store = MemoryQueueStore(clock=clock)
    answered = asyncio.Event()
    beats: list[Any] = []

    class SlowBeats(LocalQueueDriver):
        async def heartbeat(self, key: Any) -> bool:
            beats.append(key)
            try:
                await answered.wait()
            except asyncio.CancelledError:
                await answered.wait()  # its answer is read before it stops
                raise
            return await super().heartbeat(key)

    queue = QueryQueue(
        "hb",
        query_handlers={"sql": rec.gated},
        driver=SlowBeats(store),
        clock=clock,
        heartbeat_interval=10.0,
    )
    caller = asyncio.create_task(queue.execute_in_queue("sql", "q", "q"))
    try:
        await wait_until(lambda: rec.running == 1 and clock.sleepers == 1)
        clock.advance(10_000)
        await wait_until(lambda: beats, what="a heartbeat in flight")
        rec.gate.set()
        # Answered while the heartbeat still waits for its round trip.
        assert await asyncio.wait_for(caller, 10) == {"echo": "q"}
        assert store.active("hb") == [] and not answered.is_set()
    finally:
        answered.set()
        caller.cancel()
        await asyncio.gather(caller, return_exceptions=True)
        await queue.close(grace=0)


class _FlakyAcks(LocalQueueDriver):
    """A store that is away for the first `failures` ACKs (a database restarting)."""

    def __init__(self, store: QueueStore, failures: int) -> None:
        super().__init__(store)
        self.failures = failures

    async def ack(self, key: Any, result: Outcome | None) -> Any:
        if self.failures:
            self.failures -= 1
            raise StoreError("the queue database went away")
        return await super().ack(key, result)


async def test_an_ack_is_retried_through_an_outage_and_its_waiters_answered(
    rec: Recorder,
) -> None:
    driver = _FlakyAcks(MemoryQueueStore(), failures=3)
    queue = QueryQueue("flaky", query_handlers={"sql": rec.instant}, driver=driver)
    try:
        assert await queue.run("sql", "k", "k", timeout=30) == {"echo": "k"}
        assert rec.calls == ["k"] and driver.failures == 0
    finally:
        await queue.close(grace=0)


async def test_an_execution_whose_ack_never_lands_says_so(rec: Recorder) -> None:
    clock = ManualClock()
    store = MemoryQueueStore(clock=clock)
    driver = _FlakyAcks(store, failures=10**6)
    queue = QueryQueue(
        "flaky", query_handlers={"sql": rec.instant}, driver=driver, clock=clock, reconcile=False
    )
    queue.executor.ack_retry_timeout = 1.0
    added = store.add("flaky:k", '{"queryHandler": "sql", "query": "k"}')
    got = store.retrieve(added.id, concurrency=1)
    assert got is not None
    executing = asyncio.ensure_future(
        queue.execute_query(
            RetrievedQuery("k", added.id, added.id, 0, {"queryHandler": "sql", "query": "k"})
        )
    )
    while not executing.done():  # step the backoff on the clock: 0.05, 0.1, ... 1 s in all
        await wait_until(lambda: clock.sleepers == 1 or executing.done())
        clock.advance(2_000)
    assert await executing is False  # the pool gives such an item back
    assert [row.queue_id for row in store.active("flaky")] == [added.id]
    await queue.close(grace=0)


class _AwayForHeartbeats(LocalQueueDriver):
    """A store whose heartbeats are lost while `away` (an outage, as its executors see it)."""

    away = False

    async def heartbeat(self, key: Any) -> bool:
        if self.away:
            raise StoreError("the queue database went away")
        return await super().heartbeat(key)


async def test_an_execution_here_whose_heartbeats_were_lost_is_beaten_not_reaped(
    rec: Recorder,
) -> None:
    """Past the stall timeout without a heartbeat landing (the store was away), the item
    this process still executes is stalled by its heartbeat alone. This process's reaper
    knows better: it beats it rather than reclaim it (which would run it twice)."""
    clock, store, queue = _on_a_manual_clock(rec, "hb", rec.gated, _AwayForHeartbeats)
    driver = queue.driver
    assert isinstance(driver, _AwayForHeartbeats)
    caller = asyncio.create_task(queue.execute_in_queue("sql", "late", "late"))
    try:
        await wait_until(lambda: rec.running == 1 and clock.sleepers == 1)
        driver.away = True
        for _ in range(5):  # five heartbeat periods, every heartbeat lost
            clock.advance(10_000)
            await wait_until(lambda: clock.sleepers == 1)
        driver.away = False
        (running,) = store.active("hb")
        assert [row.queue_id for row in store.stalled(40_000, "hb")] == [running.queue_id]
        await queue.reconcile_queue()
        assert rec.cancelled == [] and rec.named(ev.REMOVING_ORPHANED) == []
        assert store.stalled(40_000, "hb") == []
        assert [row.queue_id for row in store.active("hb")] == [running.queue_id]
        rec.gate.set()
        assert await asyncio.wait_for(caller, 10) == {"echo": "late"}
        assert rec.calls == ["late"]
    finally:
        caller.cancel()
        await asyncio.gather(caller, return_exceptions=True)
        await queue.close(grace=0)


async def test_an_item_held_here_for_a_live_executor_is_not_reaped_until_let_go(
    rec: Recorder,
) -> None:
    """`held_here`: what a supervisor's pool holds for its live workers (it heartbeats
    them itself) is beaten by the reaper when its heartbeat is stale; once let go (its
    worker dead, nobody beating it) it is reaped as stalled."""
    held: set[Any] = set()
    handed: list[RetrievedQuery] = []

    async def hand_off(retrieved: RetrievedQuery) -> None:
        handed.append(retrieved)
        held.add(retrieved.queue_id)

    clock, store, queue = _on_a_manual_clock(
        rec, "pool", rec.instant, send_process_message_fn=hand_off
    )
    queue.held_here = held.__contains__
    try:
        store.add("pool:k", '{"queryHandler": "sql", "query": "k"}')
        await queue.reconcile_queue()
        (retrieved,) = handed
        clock.advance(60_000)  # no heartbeat for longer than the stall timeout
        await queue.reconcile_queue()
        assert rec.cancelled == [] and store.stalled(40_000, "pool") == []
        assert [row.queue_id for row in store.active("pool")] == [retrieved.queue_id]
        held.clear()  # its worker died unnoticed: nobody beats it any more
        clock.advance(60_000)
        await queue.reconcile_queue()
        await wait_until(lambda: len(rec.cancelled) == 1, what="the stalled item reaped")
        assert store.active("pool") == []
        assert [e["queueId"] for e in rec.named(ev.REMOVING_ORPHANED)] == [retrieved.queue_id]
    finally:
        await queue.close(grace=0)


async def test_a_sync_handler_waited_for_on_the_spot_is_acked_without_waking_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pool worker's setting (`sync_handler_wait`): the handler still runs in a thread,
    its outcome is taken there and then, and the ACK follows in the same loop turn."""
    store = MemoryQueueStore()
    ran_on: list[int] = []

    def handler(query: Any, set_cancel_handler: Any) -> dict[str, Any]:
        ran_on.append(threading.get_ident())
        return {"echo": query}

    queue = QueryQueue("spot", query_handlers={"sql": handler}, driver=store, reconcile=False)
    queue.executor.sync_handler_wait = 10.0
    loop = asyncio.get_running_loop()
    added = store.add("spot:k", '{"queryHandler": "sql", "query": "k"}')
    assert store.retrieve(added.id, concurrency=1) is not None
    woken = record_calls(monkeypatch, loop, "call_soon_threadsafe")
    try:
        done = await queue.execute_query(
            RetrievedQuery("k", added.id, added.id, 0, {"queryHandler": "sql", "query": "k"}, 1)
        )
    finally:
        await queue.close(grace=0)
    assert done and woken == []
    assert ran_on and ran_on[0] != threading.get_ident()
    stored = store.result(added.id)
    assert stored is not None and stored.payload is not None
    assert orjson.loads(stored.payload) == {"result": {"echo": "k"}}


@pytest.mark.parametrize("listening", [False, True], ids=["quiet", "listened-to"])
async def test_a_fast_tracked_add_lists_the_active_keys_only_for_a_listener(
    monkeypatch: pytest.MonkeyPatch, listening: bool
) -> None:
    """The active keys an ADD_AND_RETRIEVE answers are the "Waiting for query" event's
    only: without a listener it asks for no listing (a statement a query), as the queued
    path skips its own."""
    import functools
    import logging

    monkeypatch.setattr(logging.getLogger("queryqueue.queue"), "level", logging.WARNING)
    store = MemoryQueueStore()
    asked: list[bool] = []
    real = store.add_and_retrieve

    @functools.wraps(real)
    def recording(*args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs.get("list_active", True))
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "add_and_retrieve", recording)
    events: list[tuple[str, dict[str, Any]]] = []
    queue = QueryQueue(
        "ft",
        query_handlers={"sql": lambda query, _: {"echo": query}},
        driver=store,
        logger=(lambda name, fields: events.append((name, fields))) if listening else None,
    )
    try:
        assert await queue.execute_in_queue("sql", "k", {"x": 1}, priority=10) == {"echo": {"x": 1}}
    finally:
        await queue.close(grace=0)
    assert asked == [listening]
    if listening:
        (waiting,) = [fields for name, fields in events if name == ev.WAITING_FOR_QUERY]
        assert waiting["fastTrack"] and waiting["activeQueryKeys"] == [queue.hash_query_key("k")]
