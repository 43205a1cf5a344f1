"""A handler registered with `retries` runs again after a transient failure: up to its
limit, for its `retry_on` errors only, within the query's execution timeout, and each
retry is an event with its attempt; cancelled and timed-out queries never run again."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from queryqueue import MemoryQueueStore, QueryCancelledError, QueryError, QueueApp
from queryqueue.engine.errors import InvalidCommandError, QueryTimeoutError
from queryqueue.engine.retrying import HandlerPolicy
from tests.waiting import wait_until


def _app(fails: int, *, error: type[Exception] = ConnectionError, **options: Any) -> QueueApp:
    """An app whose handler `flaky` fails `fails` times with `error`, then answers."""
    events: list[tuple[str, dict[str, Any]]] = []
    app = QueueApp("retries", logger=lambda message, fields: events.append((message, fields)))
    app.state.events, app.state.calls = events, []

    @app.handler("flaky", **options)
    async def flaky(query: Any) -> Any:
        app.state.calls.append(query)
        if len(app.state.calls) <= fails:
            raise error(f"attempt {len(app.state.calls)} failed")
        return {"attempts": len(app.state.calls)}

    return app


def _retries(app: QueueApp) -> list[int]:
    return [f["attempt"] for message, f in app.state.events if message == "Retrying query"]


async def test_a_transient_failure_is_run_again_until_it_answers() -> None:
    app = _app(2, retries=3, retry_on=(ConnectionError,), backoff=0.01)
    queue = app.make_queue(MemoryQueueStore())
    try:
        assert await queue.run("flaky", "k", {"n": 1}) == {"attempts": 3}
    finally:
        await queue.close(grace=0)
    assert _retries(app) == [1, 2]


async def test_past_its_retries_the_last_error_is_the_querys() -> None:
    app = _app(5, retries=2, backoff=0.01)
    queue = app.make_queue(MemoryQueueStore())
    try:
        with pytest.raises(QueryError, match="attempt 3 failed"):
            await queue.run("flaky", "k", {})
    finally:
        await queue.close(grace=0)
    assert len(app.state.calls) == 3 and _retries(app) == [1, 2]


async def test_an_error_its_policy_does_not_name_is_not_retried() -> None:
    app = _app(1, error=ValueError, retries=3, retry_on=(ConnectionError,), backoff=0.01)
    queue = app.make_queue(MemoryQueueStore())
    try:
        with pytest.raises(QueryError, match="attempt 1 failed"):
            await queue.run("flaky", "k", {})
    finally:
        await queue.close(grace=0)
    assert len(app.state.calls) == 1 and _retries(app) == []


async def test_no_retry_starts_past_the_execution_timeout() -> None:
    """A first retry would wait at least half its 2 s backoff: past the 0.5 s the query
    has in all, so the first failure is the query's."""
    app = _app(1, retries=3, backoff=2.0)
    queue = app.make_queue(MemoryQueueStore(), execution_timeout=0.5)
    try:
        with pytest.raises(QueryError, match="attempt 1 failed"):
            await queue.run("flaky", "k", {})
    finally:
        await queue.close(grace=0)
    assert len(app.state.calls) == 1


def test_cancelled_and_timed_out_queries_never_run_again_and_bad_policies_are_refused() -> None:
    policy = HandlerPolicy(retries=5)
    assert policy.retries_after(ConnectionError(), 1) and not policy.retries_after(OSError(), 6)
    assert not policy.retries_after(QueryCancelledError("cancelled"), 1)
    assert not policy.retries_after(QueryTimeoutError("timed out"), 1)
    assert 0.5 <= HandlerPolicy(backoff=1.0).delay(1) <= 1.5
    assert HandlerPolicy(backoff=1.0).delay(3, jitter=lambda: 0.5) == 4.0
    app = QueueApp("bad")
    with pytest.raises(ValueError, match="retries must be a whole number"):
        app.handler("x", retries=-1)
    with pytest.raises(TypeError, match="retry_on takes exception classes"):
        app.handler("x", retries=1, retry_on=("ConnectionError",))  # type: ignore[arg-type]


async def test_a_handlers_own_execution_timeout_bounds_its_queries_and_names_itself() -> None:
    """A handler's `execution_timeout` (0.2 s) within the queue's (600 s): its slow query
    fails at its own, with the message naming it; another handler keeps the queue's."""
    app = QueueApp("timeouts")

    @app.handler("quick", execution_timeout=0.2)
    async def quick(query: Any) -> str:
        await asyncio.sleep(60)
        return "never"

    @app.handler("other")
    async def other(query: Any) -> str:
        await asyncio.sleep(0.3)
        return "done"

    queue = app.make_queue(MemoryQueueStore())
    try:
        with pytest.raises(QueryTimeoutError, match=r"timeout after 0\.2 s"):
            await queue.run("quick", "k", {})
        assert await queue.run("other", "k2", {}) == "done"
    finally:
        await queue.close(grace=0)
    with pytest.raises(ValueError, match="execution_timeout must be positive seconds"):
        app.handler("bad", execution_timeout=0)


async def test_a_calls_own_execution_timeout_bounds_the_query_it_enqueues() -> None:
    """`run(..., execution_timeout=0.2)`: the query it enqueues fails at 0.2 s, the message
    naming it; the same handler asked without one runs to its end. A timeout that is not
    positive seconds is refused before anything is queued."""
    app = QueueApp("per_call")

    @app.handler("wait")
    async def wait(query: Any) -> str:
        await asyncio.sleep(query["seconds"])
        return "done"

    queue = app.make_queue(MemoryQueueStore())
    try:
        with pytest.raises(QueryTimeoutError, match=r"timeout after 0\.2 s"):
            await queue.run("wait", "slow", {"seconds": 60}, execution_timeout=0.2)
        assert await queue.run("wait", "fine", {"seconds": 0.3}) == "done"
        for bad in (0, -1, "5", True):
            with pytest.raises(InvalidCommandError, match="execution_timeout must be positive"):
                await queue.run("wait", "bad", {"seconds": 0}, execution_timeout=bad)  # type: ignore[arg-type]
        assert await queue.connection.get_to_process_queries() == []
    finally:
        await queue.close(grace=0)


async def test_a_retry_marks_the_running_items_attempt() -> None:
    """Each retry writes the attempt it starts into the item's extra, where `queryqueue
    status` and the supervisor's metrics see it while the query runs."""
    app = QueueApp("marked")
    release, calls = asyncio.Event(), []

    @app.handler("flaky", retries=2, retry_on=(ConnectionError,), backoff=0.01)
    async def flaky(query: Any) -> str:
        calls.append(query)
        if len(calls) <= 2:
            raise ConnectionError(f"attempt {len(calls)} failed")
        await release.wait()
        return "done"

    queue = app.make_queue(MemoryQueueStore())

    async def attempt() -> Any:
        running = await queue.get_queries()
        return running[0].get("attempt") if running else None

    async def third() -> bool:  # marked as it is scheduled, then started
        return await attempt() == 3 and len(calls) == 3

    try:
        asking = asyncio.create_task(queue.run("flaky", "k", {}))
        await wait_until(third, what="the item's third attempt, running")
        release.set()
        assert await asking == "done"
    finally:
        await queue.close(grace=0)
