"""QueryQueue on every store, a query run for its callers: its result, dedup, errors,
priorities, the budget, continue-waits, jobs, forced builds, bad input and the execution
timeout."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from queryqueue import ContinueWaitError, QueryError, QueryQueue
from queryqueue.engine import events as ev
from tests.query_queue.helpers import (
    MakeQueue,
    Recorder,
    active_keys,
    empty,
    items_of,
    wait_pending,
)
from tests.waiting import wait_until


async def _waiting(queue: QueryQueue, count: int) -> bool:
    return bool((await queue.driver.stats())["waiters"] == count)


async def test_result_is_returned_and_a_later_call_runs_again(
    make_queue: MakeQueue, rec: Recorder
) -> None:
    queue = make_queue(query_handlers={"sql": rec.instant}, logger=rec.log)
    assert await queue.execute_in_queue("sql", ["SELECT 1", []], {"sql": 1}) == {"echo": {"sql": 1}}
    # The waiter took the result: the queue shares in-flight work, it is not a cache.
    assert await queue.execute_in_queue("sql", ["SELECT 1", []], {"sql": 1}) == {"echo": {"sql": 1}}
    assert len(rec.calls) == 2 and len(rec.named(ev.ADDED_TO_QUEUE)) == 2
    assert await items_of(queue) == []


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
    await wait_until(lambda: active_keys(queue))
    waiting = []
    for name, priority in [("low-1", 0), ("high-1", 5), ("low-2", 0), ("high-2", 5), ("urgent", 9)]:
        waiting.append(asyncio.create_task(queue.execute_in_queue("sql", name, name, priority)))
        await wait_pending(queue, len(waiting))
    blocker_release.set()
    await asyncio.gather(blocker, *waiting)
    assert order == ["blocker", "urgent", "high-1", "high-2", "low-1", "low-2"]


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
    await wait_until(lambda: empty(queue))
    assert await queue.execute_in_queue("sql", "slow", {"q": 1}) == {"echo": {"q": 1}}
    assert len(rec.calls) == 1


async def test_is_job_returns_at_once_and_runs(make_queue: MakeQueue, rec: Recorder) -> None:
    queue = make_queue(query_handlers={"sql": rec.gated})
    assert await queue.execute_in_queue("sql", "job", {"isJob": True}) is None
    await wait_until(lambda: len(rec.calls) == 1)
    rec.gate.set()
    await wait_until(lambda: empty(queue))


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
    assert await items_of(queue) == []
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
