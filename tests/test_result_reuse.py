"""`max_age`: a call answered from the query's stored result while it is young enough,
read before or not, without running the query again; concurrent identical calls still
share one execution; and a handle from `@app.handler` runs its handler, typed."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from queryqueue import InvalidCommandError, MemoryQueueStore, QueueApp
from queryqueue.driver_sqlite import SqliteQueueStore
from queryqueue.engine.clock import ManualClock
from tests.pool_util import pool_server


def _counting_app(**handler_options: Any) -> QueueApp:
    """An app whose handler `report` answers the query with how many times it ran."""
    app = QueueApp("reuse")
    app.state.runs = 0

    @app.handler("report", **handler_options)
    async def report(query: dict[str, Any]) -> dict[str, Any]:
        app.state.runs += 1
        return {"query": query, "run": app.state.runs}

    return app


async def test_a_result_read_already_answers_a_call_within_its_max_age_only() -> None:
    app = _counting_app()
    clock = ManualClock()
    queue = app.make_queue(MemoryQueueStore(clock=clock))
    try:
        first = await queue.run("report", "k", {"n": 1})
        assert first == {"query": {"n": 1}, "run": 1}
        clock.advance(20_000)
        assert await queue.run("report", "k", {"n": 1}, max_age=30) == first
        assert await queue.run("report", "k", {"n": 1}, max_age=25.5) == first
        assert app.state.runs == 1
        # Too old for this call, and without a max age: the query runs again.
        assert (await queue.run("report", "k", {"n": 1}, max_age=19))["run"] == 2
        assert (await queue.run("report", "k", {"n": 1}))["run"] == 3
        # The newest result is the one reused.
        assert (await queue.run("report", "k", {"n": 1}, max_age=1))["run"] == 3
    finally:
        await queue.close(grace=0)


async def test_a_handlers_max_age_is_its_calls_default() -> None:
    app = _counting_app(max_age=60)
    clock = ManualClock()
    queue = app.make_queue(MemoryQueueStore(clock=clock))
    try:
        first = await queue.run("report", "k", {"n": 1})
        clock.advance(59_000)
        assert await queue.run("report", "k", {"n": 1}) == first
        assert (await queue.run("report", "k", {"n": 1}, max_age=10))["run"] == 2  # the call's
        clock.advance(61_000)
        assert (await queue.run("report", "k", {"n": 1}))["run"] == 3
    finally:
        await queue.close(grace=0)


async def test_concurrent_identical_calls_with_a_max_age_share_one_execution() -> None:
    app = QueueApp("reuse")
    started, release, runs = asyncio.Event(), asyncio.Event(), []

    @app.handler("slow")
    async def slow(query: str) -> str:
        runs.append(query)
        started.set()
        await release.wait()
        return f"ran {query}"

    queue = app.make_queue(MemoryQueueStore())
    try:
        calls = [asyncio.create_task(queue.run("slow", "k", "q", max_age=60)) for _ in range(20)]
        await asyncio.wait_for(started.wait(), 10)
        release.set()
        assert await asyncio.gather(*calls) == ["ran q"] * 20
        assert await queue.run("slow", "k", "q", max_age=60) == "ran q"
        assert runs == ["q"]
    finally:
        await queue.close(grace=0)


@pytest.mark.parametrize("max_age", [0, -1, "60", True, float("nan")])
async def test_a_max_age_that_is_not_positive_seconds_is_refused_before_anything_is_queued(
    max_age: Any,
) -> None:
    app = _counting_app()
    store = MemoryQueueStore()
    queue = app.make_queue(store)
    try:
        with pytest.raises(InvalidCommandError, match="max_age must be positive seconds"):
            await queue.run("report", "k", {"n": 1}, max_age=max_age)
        assert store.list_items("reuse") == [] and app.state.runs == 0
    finally:
        await queue.close(grace=0)
    with pytest.raises(ValueError, match="max_age must be positive seconds"):
        app.handler("other", max_age=0)


async def test_a_handle_runs_its_handler_in_the_pool_and_reuses_its_result(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a supervisor: the handle's `run` is its handler's, answered by a worker;
    with a max age the next call runs nothing; a result kept in shared memory, once read,
    is never reused (its bytes went back with the read): the query runs again."""
    from tests.apps import pool_app

    trace = workdir / "trace"
    monkeypatch.setenv("POOL_TRACE", str(trace))
    monkeypatch.setenv("QUERYQUEUE_SOCKET", str(workdir / "s.sock"))

    def starts(key: str) -> int:
        lines = trace.read_text().splitlines() if trace.exists() else []
        return sum(1 for line in lines if line.split()[:2] == ["start", key])

    store = SqliteQueueStore(workdir / "q.db")
    async with pool_server(store, workdir, workers=1):
        try:
            first = await pool_app.run.run({"key": "a"})
            assert first["pid"] != os.getpid() and starts("a") == 1
            assert await pool_app.run.run({"key": "a"}, max_age=60) == first
            assert starts("a") == 1
            assert (await pool_app.run.run({"key": "a"}))["pid"] == first["pid"]
            assert starts("a") == 2  # no max age: run again
            size = 3 * 1024 * 1024  # over the shared-memory threshold
            big = {"key": "b", "size": size}
            expected = pool_app.big_text(size, "b")
            assert await pool_app.big.run(big) == expected
            assert await pool_app.big.run(big, max_age=60) == expected
            assert starts("b") == 2
            async with pool_app.big.view(big) as viewed:  # text: a private copy
                assert viewed == expected
        finally:
            await pool_app.app.aclose()
