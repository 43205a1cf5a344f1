"""QueryQueue on every store, what ends a query early: orphaned and stalled items reaped,
heartbeats of a blocked handler, cancels by hand, by request id and from outside, and the
reconcile that reaps."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from queryqueue import ContinueWaitError, QueryCancelledError, QueryQueue, RetrievedQuery
from queryqueue.engine import events as ev
from tests.query_queue.helpers import (
    PREFIX,
    MakeQueue,
    Recorder,
    active_keys,
    items_of,
    statuses_of,
    wait_pending,
)
from tests.waiting import wait_until


async def _retry(queue: QueryQueue, key: str, query: Any = None, within: float = 10.0) -> Any:
    deadline = time.monotonic() + within
    while True:
        try:
            return await queue.execute_in_queue("sql", key, key if query is None else query)
        except ContinueWaitError:
            assert time.monotonic() < deadline, "no result in time"


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
    assert len(lost) == 1 and await statuses_of(dead) == ["active"]

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
    await wait_until(lambda: active_keys(queue))

    async def beaten_through_three_timeouts() -> bool:
        await queue.reconcile_queue()  # what would reap it, were it stalled
        return beats >= 12

    await wait_until(beaten_through_three_timeouts, what="twelve heartbeats")
    assert rec.cancelled == []
    defs = await items_of(queue)
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
    assert await items_of(queue) == []
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
    await wait_pending(queue, 1)
    cancelled = await queue.cancel_query_by_request_id("req-2")
    assert [c["query"] for c in cancelled] == ["b"]
    assert await statuses_of(queue) == ["active"]
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
