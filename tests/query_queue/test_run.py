"""QueryQueue on every store: `run` across long polls, its deadline and its errors; shutdown
and close; reconciles and nudges."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from queryqueue import (
    InvalidCommandError,
    QueryCancelledError,
    QueryError,
    QueryQueue,
    QueryStream,
    QueryTimeoutError,
    QueueClosedError,
    QueueDriver,
)
from queryqueue.engine import events as ev
from queryqueue.engine.outcome import encode_retry
from tests.query_queue.helpers import PREFIX, MakeQueue, Recorder, items_of, statuses_of
from tests.waiting import wait_until


async def _owned_pending(queue: QueryQueue) -> bool:
    return len(await queue.driver.pending(PREFIX, process_id=queue.process_uid)) == 1


async def _has_statuses(queue: QueryQueue, statuses: list[str]) -> bool:
    return await statuses_of(queue) == statuses


async def _no_items(queue: QueryQueue) -> bool:
    return await items_of(queue) == []


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
    assert await items_of(queue) == []


async def test_shutdown_stops_what_outlives_the_grace(make_queue: MakeQueue, rec: Recorder) -> None:
    queue = make_queue(query_handlers={"sql": rec.gated})
    caller = asyncio.create_task(queue.execute_in_queue("sql", "k", "k"))
    await wait_until(lambda: rec.running == 1)
    await asyncio.wait_for(queue.shutdown(grace=0.1), 10)
    assert rec.running == 0
    assert await statuses_of(queue) == ["active"]  # left for the stalled path to reclaim
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
    assert await items_of(queue) == []


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
