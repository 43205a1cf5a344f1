"""QueryQueue on every store: the fast track, persistent keys, streams, query stages, events
and the sync face."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from queryqueue import (
    ContinueWaitError,
    InvalidCommandError,
    QueryCancelledError,
    QueryStream,
    QueueDriver,
    RetrievedQuery,
    SqliteQueueStore,
    SyncQueryQueue,
)
from queryqueue.engine import events as ev
from tests.query_queue.helpers import PREFIX, MakeQueue, Recorder, empty, statuses_of, wait_pending
from tests.waiting import wait_until


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
    assert await statuses_of(owner) == ["pending"]
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
    assert await statuses_of(queue) == ["active"]


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
    await wait_until(lambda: empty(queue))


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
    await wait_pending(queue, 2)
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
