"""QueryQueue stepped by an injected clock, and through outages of its store: heartbeats,
ACKs retried, items held for a live execution."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from queryqueue import (
    LocalQueueDriver,
    MemoryQueueStore,
    QueryQueue,
    QueueStore,
    RetrievedQuery,
    StoreError,
)
from queryqueue.engine import events as ev
from queryqueue.engine.binary import Outcome
from queryqueue.engine.clock import ManualClock
from tests.query_queue.helpers import Recorder
from tests.recording import record_calls
from tests.waiting import wait_until


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


class _AwayForHeartbeats(LocalQueueDriver):
    """A store whose heartbeats are lost while `away` (an outage, as its executors see it)."""

    away = False

    async def heartbeat(self, key: Any) -> bool:
        if self.away:
            raise StoreError("the queue database went away")
        return await super().heartbeat(key)


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
